"""Test-only helpers shared by tests/test_routing_*.py (holds no tests itself): an independent "forced routing" router forward (the
reference that replay must equal), a hook capturing the experts a router actually used, and the CPU
stand-ins Megatron's activation recompute needs.

Legend: N router tokens (router order, [S_loc, B] flattened), E experts, K top-k, T storage tokens.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def forced_routing(replay, routes_TLK):
    """Force every MoE layer of `replay`'s model to `routes_TLK` by replacing each router's forward with
    an independent computation: router logits from its own gate, softmax over the k forced logits
    (Megatron's pre_softmax=False form), scattered into dense probs and a routing map. Does not touch
    Megatron's RouterReplay."""
    from moe.routing_replay import router_token_index

    tp_rank, tp_size = 0, 1
    if replay.sequence_parallel:
        _, tp_rank, tp_size = replay._tp()
    try:
        for l, layer in enumerate(replay.layers):
            router = layer.router

            def forward(input, padding_mask=None, router=router, l=l):
                seq_local, batch = input.shape[:2]
                index_N = router_token_index(batch, seq_local, tp_rank, replay.sequence_parallel, tp_size,
                                             device=routes_TLK.device)
                idx_NK = routes_TLK[index_N, l].long().to(input.device)
                logits_NE = router.gating(input).view(-1, router.config.num_moe_experts)
                probs_NK = torch.softmax(logits_NE.gather(1, idx_NK), dim=-1, dtype=torch.float32).type_as(logits_NE)
                probs_NE = torch.zeros_like(logits_NE).scatter(1, idx_NK, probs_NK)
                map_NE = torch.zeros_like(logits_NE, dtype=torch.bool).scatter(1, idx_NK, True)
                return probs_NE, map_NE

            router.forward = forward
        yield
    finally:
        for layer in replay.layers:
            layer.router.__dict__.pop("forward", None)


@contextlib.contextmanager
def used_experts(replay):
    """Capture, per forward call, the experts each router's routing map selected: [T, L, K] in storage
    order, experts sorted ascending. Yields a list that fills as forwards run."""
    calls: list[list] = [[] for _ in replay.layers]
    out: list = []
    handles = []

    def make_hook(l):
        def hook(module, args, output):
            if torch._C._current_graph_task_id() != -1:
                return
            seq_local, batch = args[0].shape[:2]
            map_NE = output[1]
            idx_NK = map_NE.nonzero()[:, 1].view(map_NE.shape[0], -1)
            calls[l].append((idx_NK, batch, seq_local))
        return hook

    try:
        for l, layer in enumerate(replay.layers):
            handles.append(layer.router.register_forward_hook(make_hook(l)))
        yield out
    finally:
        for h in handles:
            h.remove()
    for call in range(len(calls[0])):
        per_layer = [replay._to_storage(*calls[l][call]) for l in range(len(replay.layers))]
        out.append(torch.stack(per_layer, dim=1))


def sorted_routes(routes_TLK):
    return routes_TLK.long().sort(dim=-1).values


def allow_cpu_recompute() -> None:
    """Megatron's CheckpointFunction saves and restores the CUDA RNG state; on CPU use the CPU state
    (dropout is 0 in these models, so RNG state does not affect results). Test processes only; nothing in a
    process whose model runs on CUDA (moe.device.use_cuda), where Megatron's own CUDA RNG handling applies."""
    import megatron.core.tensor_parallel.random as megatron_random

    from moe.device import use_cuda

    if use_cuda():
        return

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: None


def perturb_routers(full_weights: dict, seed: int, scale: float = 0.5) -> dict:
    """A copy of a full state dict with every router weight perturbed (same on every rank for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in full_weights.items():
        if name.endswith("mlp.router.weight"):
            # drawn on the CPU (same perturbation for a seed on every device), added on the tensor's device
            tensor = tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=gen).to(tensor.device)
        out[name] = tensor.clone()
    return out
