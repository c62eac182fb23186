"""Routing replay over gloo at TP=2 (sequence parallel), EP=2 and TP=2+EP=2, on a model mixing dense and
MoE layers.

One spawned 2-rank run covers all three layouts (process start-up and the Megatron import dominate a
run's time on 2 cores). Per layout: routes recorded by the layout equal the 1-process model's routes for
the rank's rows (storage order survives the TP sequence split and the all-gather); after perturbing the
routers, replay selects exactly the recorded experts, and its logits and gradients equal a forward forced
to those experts, while a forward without replay routes differently.
Tolerance as in test_routing_replay.py (same float32 ops, same order).
"""

from __future__ import annotations

import pytest
import torch

from devices import megatron_groups
from helpers import scaled_close, tiny_arch
from multiprocess import run_distributed

ARCH = tiny_arch("mixed", num_hidden_layers=3, num_experts=8, router_aux_loss_coef=0.0)
BATCH, SEQ = 4, 8


def _body(rank, world_size, layout_kwargs, seed):
    from megatron.core import parallel_state as ps
    from test_routing_support import forced_routing, perturb_routers, sorted_routes, used_experts

    from moe.model import build_model, forward_logits
    from moe.parallel import destroy_model_parallel
    from moe.routing_replay import RoutingReplay
    from moe.sharding import load_full_state_dict
    from moe.volatility import expert_volatility

    arch = ARCH
    tokens_BS = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))

    megatron_groups(seed)
    reference = build_model(arch, routing_replay=True)
    weights = {n: p.detach().clone() for n, p in reference.named_parameters()}
    with torch.no_grad(), RoutingReplay(reference).recording() as rec:
        forward_logits(reference, tokens_BS)
    ref_routes = rec.routes  # [B*S, L, K], storage order
    del reference
    destroy_model_parallel()

    layout = megatron_groups(seed, **layout_kwargs)
    model = build_model(arch, layout, routing_replay=True)
    model.train()
    load_full_state_dict(model, weights)
    replay = RoutingReplay(model)
    rows = BATCH // ps.get_data_parallel_world_size()
    row0 = ps.get_data_parallel_rank() * rows
    local_BS = tokens_BS[row0:row0 + rows]
    with torch.no_grad(), replay.recording() as rec:
        forward_logits(model, local_BS)
    routes = rec.routes
    out = {"record_equal": torch.equal(routes, ref_routes[row0 * SEQ:(row0 + rows) * SEQ]),
           "sp": replay.sequence_parallel}

    load_full_state_dict(model, perturb_routers(weights, seed + 1))
    model.zero_grad(set_to_none=True)
    with replay.replaying(routes), used_experts(replay) as used:
        logits = forward_logits(model, local_BS)
        logits.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with forced_routing(replay, routes):
        forced = forward_logits(model, local_BS)
        forced.pow(2).mean().backward()
    forced_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad(), replay.recording() as free:
        free_logits = forward_logits(model, local_BS)
    # Volatility is a global statistic: the counts are summed over the data-parallel group, as the trainer does.
    from moe.volatility import VolatilityTally

    tally = VolatilityTally()
    tally.add(routes, free.routes)
    counts = torch.tensor(tally.counts(), dtype=torch.float64)
    torch.distributed.all_reduce(counts, group=ps.get_data_parallel_group())
    dp_vol = VolatilityTally.fraction(*counts.tolist())
    destroy_model_parallel()
    out.update(
        used_equal=torch.equal(sorted_routes(used[0]), sorted_routes(routes)),
        logits=(logits.detach(), forced.detach()),
        grads={n: (grads[n], forced_grads[n]) for n in forced_grads},
        grad_names=(sorted(grads), sorted(forced_grads)),
        free_diff=float((free_logits - logits.detach()).abs().max()),
        free_vol=float(expert_volatility(routes, free.routes)),
        dp_vol=float(dp_vol),
    )
    return out


LAYOUTS = {
    "tp2": dict(tensor_parallel=2),
    "ep2": dict(expert_parallel=2),
    "tp2_ep2": dict(tensor_parallel=2, expert_parallel=2),
}


_close = scaled_close(rtol=1e-6, atol_scale=1e-6, atol_floor=1e-9)


def _all_layouts_body(rank, world_size, seed):
    return {name: _body(rank, world_size, kwargs, seed + i) for i, (name, kwargs) in enumerate(LAYOUTS.items())}


@pytest.mark.multiprocess
def test_replay_exact_under_parallel_layouts():
    seed = int(torch.randint(0, 2**31 - 1 - len(LAYOUTS), ()).item())
    results = run_distributed(_all_layouts_body, world_size=2, args=(seed,), timeout_s=400)
    assert set(results[0]) == set(LAYOUTS)
    for i, layout in enumerate(LAYOUTS):
        _check_layout(layout, seed + i, [r[layout] for r in results])


def _check_layout(layout, seed, outs):
    for rank, out in enumerate(outs):
        what = f"seed {seed} {layout} rank {rank}"
        assert out["sp"] == (layout != "ep2")
        assert out["record_equal"], f"{what}: recorded routes differ from the 1-process model's"
        assert out["used_equal"], f"{what}: replay did not select exactly the recorded experts"
        _close(*out["logits"], f"{what} logits vs forced routing")
        assert out["grad_names"][0] == out["grad_names"][1]
        for name, (g, ref) in out["grads"].items():
            _close(g, ref, f"{what} grad {name} vs forced routing")
        assert out["free_vol"] > 0 and out["free_diff"] > 1e-4, f"{what}: without replay routing did not change"
    assert outs[0]["dp_vol"] == outs[1]["dp_vol"] > 0
