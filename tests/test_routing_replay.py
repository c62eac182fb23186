"""Routing replay (moe.routing_replay) and expert-activation volatility (moe.volatility).

Unit tests: compact dtype and bytes per token (Qwen3-30B-A3B: 384), the storage <-> router token order
under sequence parallelism, loud validation errors naming the sample, packing of per-sample routes.

One spawned 1-rank Megatron run on a model mixing dense and MoE layers checks, on a packed [1, T] input
(two sequences, block-causal mask) and a padded [B, S] batch: after perturbing the routers, replay selects
exactly the recorded experts and its logits and gradients equal a forward forced to those experts
(`test_routing_support.forced_routing`, independent of Megatron's RouterReplay) while a forward without
replay differs; gradient accumulation over two micro-batches with full activation recompute replays each
micro-batch's routes in backward; volatility is 0 with replay and > 0 after an optimizer step without it;
a failed step leaves no replay state behind.

Tolerance: replay and the forced forward run the same float32 ops in the same order: equal to 0 atol
except a 1e-6 relative allowance for summation order in the gather/scatter of probabilities. The `cuda`
variant (marked gpu; tests/devices.py) runs the same body on the GPU with 1e-5 in place of 1e-6 (`_CLOSE`):
there the MoE unpermute's scatter-add (forward) and the permute's backward add with atomics, so two forwards on
the same routes sum expert outputs and token gradients in a run-dependent order (a few float32 ulp per sum).
"""

from __future__ import annotations

import pytest
import torch

from moe.routing_replay import (
    RouteSpec,
    RouteValidationError,
    pack_sample_routes,
    route_dtype,
    router_token_index,
    validate_routes,
)
from moe.volatility import VolatilityTally, changed_choices, expert_volatility, volatility_counts
from devices import DEVICES, child_env, megatron_groups
from helpers import scaled_close, tiny_arch
from multiprocess import run_distributed

# ---------------------------------------------------------------------------------------------------------
# Sizes and dtypes
# ---------------------------------------------------------------------------------------------------------


def test_bytes_per_token_qwen3_30b_a3b_is_384():
    assert route_dtype(128) == torch.uint8
    spec = RouteSpec(num_experts=128, topk=8, moe_layers=tuple(range(48)), num_moe_layers_total=48)
    assert spec.bytes_per_token == 384
    # A pipeline stage of 4 holds 12 of the 48 layers: 96 bytes per token on that stage.
    stage = RouteSpec(num_experts=128, topk=8, moe_layers=tuple(range(12, 24)), num_moe_layers_total=48)
    assert stage.bytes_per_token == 96


def test_dtype_switches_to_int16_above_256_experts():
    assert route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16
    assert RouteSpec(num_experts=512, topk=8, moe_layers=tuple(range(48)), num_moe_layers_total=48).bytes_per_token == 768
    with pytest.raises(ValueError, match="32768"):
        route_dtype(40000)


# ---------------------------------------------------------------------------------------------------------
# Token order
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_router_token_index_matches_megatron_layout(tp_size):
    """Storage t = b*S + s; Megatron hidden [S, B] split along S over TP ranks, flattened S-major."""
    batch, seq = 3, 8
    storage_ids_BS = torch.arange(batch * seq).view(batch, seq)  # token id = its storage position
    hidden_SB = storage_ids_BS.t()  # Megatron's [S, B] layout
    for rank in range(tp_size):
        chunk = hidden_SB.chunk(tp_size, dim=0)[rank]  # what rank's router sees under SP
        index = router_token_index(batch, seq // tp_size, rank, sequence_parallel=tp_size > 1, tp_size=tp_size)
        assert torch.equal(index, chunk.reshape(-1))
    # Without sequence parallelism every TP rank routes all tokens.
    assert torch.equal(router_token_index(batch, seq, 1, sequence_parallel=False, tp_size=2), hidden_SB.reshape(-1))


# ---------------------------------------------------------------------------------------------------------
# Validation: loud, naming the sample
# ---------------------------------------------------------------------------------------------------------

SPEC = RouteSpec(num_experts=8, topk=2, moe_layers=(0, 1, 2), num_moe_layers_total=3)


def _routes(n, layers=3, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(n * layers)]).view(n, layers, k).to(torch.uint8)


def test_pack_sample_routes_packs_in_order_and_pads():
    a, b = _routes(4, seed=1), _routes(3, seed=2)
    packed = pack_sample_routes([a, b], [4, 3], SPEC, total_tokens=9)
    assert packed.dtype == torch.uint8 and packed.shape == (9, 3, 2)
    assert torch.equal(packed[:4], a) and torch.equal(packed[4:7], b)
    assert torch.equal(packed[7:].long(), torch.tensor([0, 1]).expand(2, 3, 2))  # filler for padding


def test_pack_sample_routes_slices_pipeline_stage_layers():
    stage = RouteSpec(num_experts=8, topk=2, moe_layers=(1, 2), num_moe_layers_total=3)
    a = _routes(4)
    assert torch.equal(pack_sample_routes([a], [4], stage), a[:, 1:])


def test_missing_final_token_only_when_allowed():
    a = _routes(3)
    with pytest.raises(RouteValidationError, match=r"sample 0 \(id 'req-7'\): routes cover 3 tokens, the sequence has 4"):
        pack_sample_routes([a], [4], SPEC, sample_ids=["req-7"])
    packed = pack_sample_routes([a], [4], SPEC, allow_missing_final_token=True)
    assert packed.shape == (4, 3, 2) and torch.equal(packed[:3], a)


@pytest.mark.parametrize(
    "bad, message",
    [
        (None, r"sample 1 \(id 'b'\): no routes while routing replay is on"),
        (_routes(5), r"sample 1 \(id 'b'\): routes cover 5 tokens, the sequence has 3"),
        (_routes(3, layers=2), r"sample 1 \(id 'b'\): routes are for 2 MoE layers, the model has 3"),
        (_routes(3, k=3), r"sample 1 \(id 'b'\): routes hold top-3 experts, the model routes top-2"),
        (torch.full((3, 3, 2), 9, dtype=torch.uint8), r"sample 1 \(id 'b'\): expert id 9 .* outside 0..7"),
        (torch.zeros(3, 3, 2, dtype=torch.uint8), r"sample 1 \(id 'b'\): token 0 layer 0 repeats an expert"),
        (torch.zeros(3, 3, 2, dtype=torch.float32), r"sample 1 \(id 'b'\): routes must hold integer expert ids"),
    ],
)
def test_bad_sample_routes_raise_naming_the_sample(bad, message):
    with pytest.raises(RouteValidationError, match=message):
        pack_sample_routes([_routes(4), bad, _routes(2)], [4, 3, 2], SPEC, sample_ids=["a", "b", "c"])


def test_validate_packed_routes_names_the_sample_of_the_bad_token():
    routes = _routes(9)
    routes[6, 1, 0] = 200
    cu = torch.tensor([0, 4, 7, 9])
    with pytest.raises(RouteValidationError, match=r"sample 1: expert id 200 at \(token 2, layer 1, k 0\)"):
        validate_routes(routes, SPEC, cu_seqlens_S1=cu)
    with pytest.raises(RouteValidationError, match=r"sample 2: routes end at token 8"):
        validate_routes(_routes(8), SPEC, cu_seqlens_S1=cu)
    with pytest.raises(RouteValidationError, match="routes are None"):
        validate_routes(None, SPEC)
    with pytest.raises(RouteValidationError, match="no routes at all"):
        pack_sample_routes(None, [3], SPEC)


# ---------------------------------------------------------------------------------------------------------
# Volatility
# ---------------------------------------------------------------------------------------------------------


def test_volatility_compares_top_k_as_sets_with_mask():
    old = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]], dtype=torch.uint8)  # T=3, L=1, K=2
    new = torch.tensor([[[1, 0]], [[2, 7]], [[6, 7]]], dtype=torch.uint8)
    assert changed_choices(old, new).tolist() == [[[False, False]], [[False, True]], [[True, True]]]
    assert expert_volatility(old, new).item() == pytest.approx(3 / 6)
    assert expert_volatility(old, new, mask_T=torch.tensor([1, 1, 0])).item() == pytest.approx(1 / 4)
    assert expert_volatility(old, old).item() == 0.0
    changed, total = volatility_counts(old, new)
    assert changed.tolist() == [3.0] and total.tolist() == [6.0]
    # The trainer's tally over micro-batches: counts add up, masked tokens count for nothing.
    tally = VolatilityTally()
    tally.add(old, new)
    tally.add(old, new, mask_T=torch.tensor([0, 1, 0]))
    assert tally.counts() == [4.0, 8.0]
    assert VolatilityTally.fraction(*tally.counts()) == 0.5
    assert VolatilityTally.fraction(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="one shape"):
        expert_volatility(old, new[:2])


# ---------------------------------------------------------------------------------------------------------
# Megatron: replay == forced routing, != no replay; accumulation + recompute; volatility; cleanup
# ---------------------------------------------------------------------------------------------------------

# Layer 0 dense, layers 1-3 MoE (mixed model), 8 experts top-2.
ARCH = tiny_arch("mixed", num_hidden_layers=4, num_experts=8, router_aux_loss_coef=0.0)


def _packed_inputs(lengths, vocab, gen):
    """[1, T] tokens of several sequences, positions restarting per sequence, block-causal mask."""
    total = sum(lengths)
    tokens = torch.randint(0, vocab, (1, total), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        allowed[start:start + n, start:start + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        start += n
    return tokens, positions, (~allowed)[None, None]


# by device: CUDA 1e-5 (non-deterministic atomic scatter-add in the MoE unpermute and in the permute's backward;
# see the module docstring); the CPU keeps 1e-6.
_CLOSE = {"cpu": scaled_close(rtol=1e-6, atol_scale=1e-6, atol_floor=1e-9),
          "cuda": scaled_close(rtol=1e-5, atol_scale=1e-5, atol_floor=1e-9)}


def _megatron_body(rank, world_size, seed):
    from devices import child_device
    from test_routing_support import allow_cpu_recompute, forced_routing, perturb_routers, sorted_routes, used_experts

    from moe.model import build_model, forward_logits
    from moe.routing_replay import RoutingReplay, RoutingReplayError
    from moe.sharding import load_full_state_dict
    from moe.volatility import expert_volatility

    megatron_groups(seed)  # the CPU shim in it and allow_cpu_recompute do nothing on CUDA
    allow_cpu_recompute()
    device = child_device()
    gen = torch.Generator().manual_seed(seed)
    arch = ARCH
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = build_model(arch, routing_replay=True, **recompute)
    model.train()
    replay = RoutingReplay(model)
    out = {"spec": (replay.spec.moe_layers, replay.spec.num_moe_layers_total, replay.spec.bytes_per_token),
           "device": next(model.parameters()).device.type}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    # drawn on the CPU (the same inputs for a seed on either device), then moved to the model's device
    packed = tuple(t.to(device) for t in _packed_inputs([7, 5, 4], arch.vocab_size, gen))  # T = 16
    padded = torch.randint(0, arch.vocab_size, (3, 6), generator=gen).to(device)  # [B, S], T = 18

    def run_packed():
        tokens, positions, mask = packed
        return model(input_ids=tokens, position_ids=positions, attention_mask=mask)

    def run_padded():
        return forward_logits(model, padded)

    # pi_old forward (recording), then perturb the routers: pi_theta routes differently.
    with torch.no_grad(), replay.recording() as rec:
        old_packed_logits = run_packed()
        run_padded()
    routes_packed, routes_padded = rec.microbatches
    out["routes"] = (routes_packed.shape, routes_packed.dtype, routes_padded.shape)
    # Packed order: a sequence's routes do not depend on what it is packed with (block-causal mask).
    with torch.no_grad(), replay.recording() as solo:
        model(input_ids=packed[0][:, 7:12], position_ids=packed[1][:, 7:12],
              attention_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool, device=device), 1)[None, None])
    out["packed_order"] = torch.equal(solo.routes, routes_packed[7:12])
    load_full_state_dict(model, perturb_routers(weights, seed + 1))

    for name, run, routes in (("packed", run_packed, routes_packed), ("padded", run_padded, routes_padded)):
        model.zero_grad(set_to_none=True)
        with replay.replaying(routes), used_experts(replay) as used:
            logits = run()
            logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with forced_routing(replay, routes):
            forced = run()
            forced.float().pow(2).mean().backward()
        forced_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad(), replay.recording() as free:
            free_logits = run()
        out[name] = dict(
            used_equal=torch.equal(sorted_routes(used[0]), sorted_routes(routes)),
            logits=(logits.detach(), forced.detach()),
            grads={n: (grads[n], forced_grads[n]) for n in forced_grads},
            grad_names=(sorted(grads), sorted(forced_grads)),
            free_diff=float((free_logits - logits.detach()).abs().max()),
            free_vol=float(expert_volatility(routes, free.routes)),
            replay_vol=float(expert_volatility(routes, used[0])),
        )

    # Gradient accumulation: forward mb0, forward mb1, then both backwards (as pipeline schedules order
    # them), with full recompute: backward recompute must replay mb0's routes then mb1's (REPLAY_BACKWARD).
    halves = [padded[:, :3].contiguous(), padded[:, 3:].contiguous()]
    with torch.no_grad(), replay.recording() as rec_mb:
        for h in halves:
            forward_logits(model, h)
    mb_routes = rec_mb.microbatches
    load_full_state_dict(model, perturb_routers(weights, seed + 2))
    recompute_calls = []
    hook = replay.layers[-1].router.register_forward_pre_hook(
        lambda m, a: recompute_calls.append(1) if torch._C._current_graph_task_id() != -1 else None)
    model.zero_grad(set_to_none=True)
    with replay.replaying(mb_routes) as handle:
        losses = [forward_logits(model, h).pow(2).mean() for h in halves]
        for loss in losses:
            loss.backward()
    hook.remove()
    acc = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for h, r in zip(halves, mb_routes):
        with forced_routing(replay, r):
            forward_logits(model, h).pow(2).mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["accumulation"] = dict(grads={n: (acc[n], ref[n]) for n in ref}, recompute_calls=len(recompute_calls),
                               forwards=handle.forwards_done)

    # Volatility after one optimizer step without replay, from the pi_old routes of the padded batch.
    load_full_state_dict(model, weights)
    with torch.no_grad(), replay.recording() as rec_old:
        run_padded()
    routes_old = rec_old.routes
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    model.zero_grad(set_to_none=True)
    run_padded().float().logsumexp(-1).mean().backward()
    optimizer.step()
    with torch.no_grad(), replay.recording() as rec_new:  # pi_theta's own routes, no replay
        run_padded()
    out["vol_after_step"] = float(expert_volatility(routes_old, rec_new.routes))
    with replay.replaying(routes_old), used_experts(replay) as used:
        run_padded()
    out["vol_with_replay"] = float(expert_volatility(routes_old, used[0]))

    # Loud failures, and no replay state left behind after a failure.
    errors = {}
    for label, routes in (("none", None), ("short", routes_old[:-1]), ("layers", routes_old[:, :2]),
                          ("list_short", [routes_old])):
        try:
            with replay.replaying(routes):
                run_padded()
                run_padded() if label == "list_short" else None
        except (RouteValidationError, RoutingReplayError) as exc:
            errors[label] = str(exc)
    errors["state_clean"] = all(
        l.router.router_replay.router_replay_action is None and l.router.router_replay.target_topk_idx is None
        and not l.router.router_replay.replay_backward_list and "get_replay_topk" not in l.router.router_replay.__dict__
        for l in replay.layers
    )
    out["errors"] = errors
    try:
        RoutingReplay(build_model(arch, routing_replay=False))
    except RoutingReplayError as exc:
        out["no_replay_model"] = str(exc)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DEVICES)
def test_replay_in_megatron_single_process(device):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    (out,) = run_distributed(_megatron_body, world_size=1, args=(seed,), timeout_s=240, env=child_env(device))
    assert out["device"] == device
    assert out["spec"] == ((0, 1, 2), 3, 6)  # 3 MoE layers (layer 0 dense) x top-2 x uint8
    assert out["routes"] == ((16, 3, 2), torch.uint8, (18, 3, 2))
    assert out["packed_order"], "a sequence's recorded routes changed with what it was packed with"
    for name in ("packed", "padded"):
        res = out[name]
        assert res["used_equal"], f"seed {seed} {name}: replay did not select exactly the recorded experts"
        assert res["replay_vol"] == 0.0
        _CLOSE[device](*res["logits"], f"seed {seed} {name} logits vs forced routing")
        assert res["grad_names"][0] == res["grad_names"][1]
        for pname, (g, ref) in res["grads"].items():
            _CLOSE[device](g, ref, f"seed {seed} {name} grad {pname} vs forced routing")
        assert res["free_vol"] > 0 and res["free_diff"] > 1e-4, f"seed {seed} {name}: perturbation changed nothing"
    acc = out["accumulation"]
    assert acc["forwards"] == 2 and acc["recompute_calls"] == 2, acc
    for pname, (g, ref) in acc["grads"].items():
        _CLOSE[device](g, ref, f"seed {seed} accumulation+recompute grad {pname}")
    assert out["vol_after_step"] > 0, f"seed {seed}: no expert changed after an optimizer step"
    assert out["vol_with_replay"] == 0.0
    errors = out["errors"]
    assert "routes are None" in errors["none"]
    assert "micro-batch 0: routes cover 17 tokens, the model input has 3 x 6 = 18" in errors["short"]
    assert "routes must be [tokens, 3 MoE layers, 2]" in errors["layers"] or "2 MoE layers" in errors["layers"]
    assert "forward call 2 but routes were given for 1 micro-batch" in errors["list_short"]
    assert errors["state_clean"], "a failed replay left RouterReplay state behind"
    assert "build the model with routing_replay=True" in out["no_replay_model"]
