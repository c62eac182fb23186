"""R3: routes captured by a transformers Qwen3MoeForCausalLM (the embedded rollout engine's router hooks)
replay in Megatron and give the same top-k as Megatron's own routing on the same weights.

A tiny random float32 HF model with a dense layer 0 (mlp_only_layers) and 2 MoE layers; its weights go
into Megatron through `moe.hf_checkpoint.load_hf_state_dict`. Forward hooks on every `mlp.gate`
(`Qwen3MoeTopKRouter` returns (logits, scores, indices)) capture each MoE layer's top-k for the flattened
[B*S] tokens, batch-major — the storage order of `moe.routing_replay`. Per-sample routes are packed with
`pack_sample_routes` (validation), then:
  * Megatron's own top-k (recorded) equals HF's as sets wherever HF's k-th/(k+1)-th router logit margin
    exceeds 1e-4 (float32 engines may legitimately flip exact near-ties);
  * replaying HF's routes selects exactly them, and the logits equal Megatron's own forward;
  * after perturbing Megatron's routers (pi_theta != rollout policy) replay still selects HF's experts;
  * an engine that never ran the final token (routes one short, `allow_missing_final_token`) gives the
    same logits at every scored position as full-length routes (to float32 GEMM-order noise: the filler
    route changes the per-expert batch shapes).

The `cuda` variant (marked gpu; tests/devices.py) runs the same body with both models on the GPU. Tolerances
there are stated beside each comparison in `test_transformers_routes_replay_in_megatron`.
"""

from __future__ import annotations

import pytest
import torch

from devices import DEVICES, child_env, megatron_groups
from helpers import tiny_arch
from multiprocess import run_distributed

ARCH = tiny_arch("mixed", num_hidden_layers=3, num_experts=8, router_aux_loss_coef=0.0)
BATCH, SEQ = 2, 12
MARGIN = 1e-4


def _hf_model(arch, seed):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe.hf_config import hf_config_from_architecture

    config = Qwen3MoeConfig(**hf_config_from_architecture(arch, dtype="float32"))
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def _hf_routes(model, input_ids_BS):
    """Per-sample routes [S, L_moe, K] and the k-th/(k+1)-th logit margin [S, L_moe] from gate hooks."""
    captured = []

    def hook(module, args, output):
        logits_NE, _, indices_NK = output
        top = logits_NE.topk(indices_NK.shape[1] + 1, dim=-1).values
        captured.append((indices_NK.detach(), (top[:, -2] - top[:, -1]).detach()))

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids_BS).logits
    finally:
        for h in handles:
            h.remove()
    batch, seq = input_ids_BS.shape
    routes_BSLK = torch.stack([c[0] for c in captured], dim=1).view(batch, seq, len(gates), -1)
    margin_BSL = torch.stack([c[1] for c in captured], dim=1).view(batch, seq, len(gates))
    return list(routes_BSLK.unbind(0)), margin_BSL.reshape(batch * seq, len(gates)), logits


def _body(rank, world_size, seed):
    from devices import child_device
    from test_routing_support import perturb_routers, sorted_routes, used_experts

    from moe.hf_checkpoint import load_hf_state_dict
    from moe.model import build_model, forward_logits
    from moe.routing_replay import RoutingReplay, pack_sample_routes
    from moe.sharding import load_full_state_dict

    megatron_groups(seed)  # the CPU shim does nothing on CUDA
    device = child_device()
    arch = ARCH
    hf = _hf_model(arch, seed).to(device)  # drawn on the CPU: the same weights for a seed on either device
    tokens_BS = torch.randint(0, arch.vocab_size, (BATCH, SEQ),
                              generator=torch.Generator().manual_seed(seed)).to(device)
    samples, margin_TL, hf_logits = _hf_routes(hf, tokens_BS)

    model = build_model(arch, routing_replay=True)
    load_hf_state_dict(model, hf.state_dict(), arch)
    replay = RoutingReplay(model)
    engine_TLK = pack_sample_routes(samples, [SEQ] * BATCH, replay.spec, sample_ids=["a", "b"])

    with torch.no_grad(), replay.recording() as rec:
        own_logits = forward_logits(model, tokens_BS)
    own_TLK = rec.routes
    with torch.no_grad(), replay.replaying(engine_TLK), used_experts(replay) as used:
        replay_logits = forward_logits(model, tokens_BS)

    # Engine that never ran the final token of each sequence.
    short = [s[:-1] for s in samples]
    short_TLK = pack_sample_routes(short, [SEQ] * BATCH, replay.spec, allow_missing_final_token=True)
    with torch.no_grad(), replay.replaying(short_TLK):
        short_logits = forward_logits(model, tokens_BS)

    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    load_full_state_dict(model, perturb_routers(weights, seed + 1))
    with torch.no_grad(), replay.replaying(engine_TLK), used_experts(replay) as used_perturbed:
        forward_logits(model, tokens_BS)
    with torch.no_grad(), replay.recording() as free:
        forward_logits(model, tokens_BS)

    decided = margin_TL > MARGIN
    same_TL = (sorted_routes(own_TLK) == sorted_routes(engine_TLK)).all(dim=-1)
    return dict(
        device=str(own_logits.device.type), engine_device=str(engine_TLK.device.type),
        engine_shape=tuple(engine_TLK.shape), engine_dtype=engine_TLK.dtype,
        same_where_decided=bool(same_TL[decided].all()), decided=int(decided.sum()), total=decided.numel(),
        mismatches=int((~same_TL).sum()),
        used_equal=torch.equal(sorted_routes(used[0]), sorted_routes(engine_TLK)),
        used_equal_perturbed=torch.equal(sorted_routes(used_perturbed[0]), sorted_routes(engine_TLK)),
        free_changed=not torch.equal(sorted_routes(free.routes), sorted_routes(engine_TLK)),
        logits=(replay_logits, own_logits, hf_logits),
        scored=(short_logits[:, :-1], replay_logits[:, :-1]),
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DEVICES)
def test_transformers_routes_replay_in_megatron(device):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    (out,) = run_distributed(_body, world_size=1, args=(seed,), timeout_s=240, env=child_env(device))
    assert out["device"] == device and out["engine_device"] == device, out["device"]
    cuda = device == "cuda"
    assert out["engine_shape"] == (BATCH * SEQ, 2, 2) and out["engine_dtype"] == torch.uint8
    assert out["decided"] >= out["total"] - 2, f"seed {seed}: too many near-ties to compare"
    assert out["same_where_decided"], f"seed {seed}: HF and Megatron top-k differ on the same weights"
    assert out["mismatches"] <= out["total"] - out["decided"]
    assert out["used_equal"] and out["used_equal_perturbed"], f"seed {seed}: replay did not use the engine's routes"
    assert out["free_changed"], f"seed {seed}: router perturbation changed no route"
    replay_logits, own_logits, hf_logits = out["logits"]
    if out["mismatches"] == 0:
        # CUDA: the same 1e-5 (two forwards of one model on the same routes; only the order of the unpermute's
        # atomic scatter-add differs, ~1e-7 relative in float32).
        torch.testing.assert_close(replay_logits, own_logits, rtol=1e-5, atol=1e-5)
    # Same weights, same routes: Megatron's logits match HF's (float32; attention/norm op order differs).
    # CUDA: 2e-4 (HF's SDPA takes the fused memory-efficient kernel and Megatron's attention another
    # accumulation order; with the scatter-add order above, twice the CPU's 1e-4).
    tol = 2e-4 if cuda else 1e-4
    torch.testing.assert_close(replay_logits, hf_logits, rtol=tol, atol=tol)
    # Not bitwise: the final token's expert changes the per-expert GEMM shapes (float32 summation order).
    # CUDA: atol 1e-5 (cuBLAS picks another algorithm per GEMM shape, plus the non-deterministic scatter-add).
    torch.testing.assert_close(*out["scored"], rtol=1e-5, atol=1e-5 if cuda else 1e-6)
