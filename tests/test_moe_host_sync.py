"""The MoE layer at EP = TP = 1 never makes the host wait for the device (moe.token_dispatch's on-device
permutation, `FastAlltoAllTokenDispatcher._dispatch_preprocess_on_device`), forward and backward, router
included, and computes what Megatron's unmodified MoEAlltoAllTokenDispatcher computes, bit for bit on the CPU in
float32: the permuted tokens, probabilities, token-of-copy map, counts per expert, the layer's output and every
gradient.

The check is tests/host_sync.py's `HostSyncDetector` (a dispatch mode plus patched host-side readers); the
first tests show it catches each kind of host synchronisation and passes sync-free code, and that it fails on
Megatron's own dispatcher path (masked_select in `permute`, the wait for the counts' device-to-host copy). On
CUDA the gpu-marked test runs the layer under `torch.cuda.set_sync_debug_mode("error")` in bfloat16.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from devices import cuda_env, megatron_groups
from helpers import tiny_arch
from host_sync import HostSyncDetector
from multiprocess import run_distributed

# six experts, top-3: several local experts (Megatron's chunk sort applies), uneven loads
ARCH = tiny_arch("moe", vocab_size=64, num_experts=6, num_experts_per_tok=3, router_aux_loss_coef=0.01)
SEQ, BATCH = 7, 2
SHARED = dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True)


# ---- the detector: each kind caught, sync-free code passes ---------------------------------------------------

_T = torch.tensor([1, 2, 3])
_S = torch.tensor(2)
_MASK = torch.tensor([True, False, True])

# kind -> (code that makes the host read the device, what the detector names)
HOST_READS = {
    "item": (lambda: _S.item(), "aten._local_scalar_dense"),
    "int": (lambda: int(_S), "aten._local_scalar_dense"),
    "bool / if": (lambda: 1 if _S else 0, "aten._local_scalar_dense"),
    "list index": (lambda: [0, 1, 2][_S], "aten._local_scalar_dense"),
    "equal": (lambda: torch.equal(_T, _T), "aten.equal"),
    "nonzero": (lambda: _T.nonzero(), "aten.nonzero"),
    "where(cond)": (lambda: torch.where(_MASK), "aten.nonzero"),
    "masked_select": (lambda: _T.masked_select(_MASK), "aten.masked_select"),
    "unique": (lambda: _T.unique(), "aten._unique2"),
    "bincount": (lambda: _T.bincount(), "aten.bincount"),
    "repeat_interleave": (lambda: _T.repeat_interleave(_T), "aten.repeat_interleave without output_size"),
    "boolean index": (lambda: _T[_MASK], "aten.index with a boolean mask"),
    "boolean index_put": (lambda: _T.clone().__setitem__(_MASK, 0), "aten.index_put_ with a boolean mask"),
    "copy to another device": (lambda: torch.empty(2, device="meta").to("cpu"), "aten._to_copy between"),
    "tolist": (lambda: _T.tolist(), "Tensor.tolist"),
    "numpy": (lambda: _T.numpy(), "Tensor.numpy"),
    "np.asarray": (lambda: np.asarray(_T), "Tensor.__array__"),
    "cpu": (lambda: _T.cpu(), "Tensor.cpu"),
    "torch.cuda.synchronize": (lambda: torch.cuda.synchronize(), "torch.cuda.synchronize"),
}


@pytest.mark.parametrize("kind", HOST_READS)
def test_detector_catches_each_kind_of_host_read(kind):
    code, named = HOST_READS[kind]
    with HostSyncDetector() as detector:
        # the copy out of a meta tensor and torch.cuda.synchronize on a CUDA-less torch raise after being seen
        with contextlib.suppress(AssertionError, RuntimeError, NotImplementedError):
            code()
    assert detector.events and detector.events[0].what.startswith(named), detector.events
    assert "test_moe_host_sync.py" in detector.events[0].where  # names the caller's line
    with pytest.raises(AssertionError, match="host synchronisation"):
        detector.assert_none(kind)


def test_detector_passes_sync_free_code_and_restores_what_it_patched():
    originals = (torch.Tensor.tolist, torch.Tensor.cpu, torch.cuda.synchronize)
    with HostSyncDetector() as detector:
        _T.repeat_interleave(_T, output_size=6)
        _T[torch.tensor([0, 2])]
        torch.where(_MASK, _T, 0).cumsum(0).scatter(0, torch.tensor([2, 0, 1]), _T)
        torch.nonzero_static(_T, size=3)
        torch._assert_async(_S > 0, "a device-side check, not a host read")
        _T.to(torch.float32).sort()
    detector.assert_none("sync-free ops")
    assert (torch.Tensor.tolist, torch.Tensor.cpu, torch.cuda.synchronize) == originals
    _T.tolist()
    assert not detector.events  # nothing is recorded after the scope


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_host_readers_that_reach_no_dispatch_mode_are_why_the_detector_patches():
    """Measured on torch 2.13's CPU build: these read tensor values on the host without an aten op a dispatch
    mode could see (numpy only dispatches a detach), so a dispatch mode alone would pass them."""
    for code in (lambda: _T.tolist(), lambda: _T.numpy(), lambda: np.asarray(_T), lambda: _T.cpu()):
        with _AtenOps() as mode:
            code()
        assert set(mode.ops) <= {"aten.detach"}, mode.ops


# ---- the permutation alone against Megatron's permute ---------------------------------------------------------


def _routing(num_tokens, num_experts, topk, gen, empty_expert=None):
    scores_NE = torch.rand(num_tokens, num_experts, generator=gen)
    if empty_expert is not None:
        scores_NE[:, empty_expert] = -1.0
    routing_NE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    return routing_NE.scatter(1, scores_NE.topk(topk, dim=1).indices, True)


@pytest.mark.parametrize("num_tokens,num_experts,topk,empty_expert",
                         [(1, 1, 1, None), (7, 5, 2, 0), (13, 8, 8, None), (37, 16, 3, 15), (6, 6, 3, 2)])
def test_expert_major_permutation_equals_megatrons_permute(num_tokens, num_experts, topk, empty_expert):
    from megatron.core.transformer.moe.moe_utils import permute

    from moe.token_dispatch import copy_positions, expert_major_permutation

    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    routing_NE = _routing(num_tokens, num_experts, topk, gen, empty_expert)
    tokens_NH = torch.randn(num_tokens, 8, generator=gen)
    probs_NE = torch.rand(num_tokens, num_experts, generator=gen)
    grad_P = torch.randn(num_tokens * topk, generator=gen)
    ref_probs = probs_NE.clone().requires_grad_(True)
    ref_tokens_PH, ref_probs_P, ref_token_of_copy_P = permute(tokens_NH, routing_NE, probs=ref_probs,
                                                              num_out_tokens=num_tokens * topk)
    (ref_probs_P * grad_P).sum().backward()
    probs = probs_NE.clone().requires_grad_(True)
    with HostSyncDetector() as detector:
        token_of_copy_P, probs_P, copy_positions_Nk = expert_major_permutation(routing_NE, probs, topk)
        (probs_P * grad_P).sum().backward()
    detector.assert_none("expert_major_permutation")
    assert torch.equal(token_of_copy_P, ref_token_of_copy_P)
    assert torch.equal(tokens_NH.index_select(0, token_of_copy_P), ref_tokens_PH)
    assert torch.equal(probs_P.detach(), ref_probs_P.detach())
    assert torch.equal(probs.grad, ref_probs.grad)
    assert torch.equal(copy_positions_Nk, copy_positions(ref_token_of_copy_P, num_tokens, topk))


def test_expert_major_permutation_refuses_a_map_without_topk_experts_per_token():
    from moe.token_dispatch import expert_major_permutation

    routing_NE = torch.tensor([[True, False, True], [False, True, False]])  # token 1 has one expert at top-2
    with pytest.raises(RuntimeError, match="topk experts per token"):
        expert_major_permutation(routing_NE, torch.rand(2, 3), 2)


# ---- the MoE layer, forward and backward, in one process ------------------------------------------------------


def _layer_call(layer, hidden_SBH, grad_SBH, padding_mask_BS=None):
    """Output and gradients (input, every parameter of the layer) of one MoE layer forward + backward."""
    layer.zero_grad(set_to_none=True)
    hidden_SBH = hidden_SBH.clone().requires_grad_(True)
    out_SBH, _ = layer(hidden_SBH, padding_mask=padding_mask_BS)
    (out_SBH.float() * grad_SBH).sum().backward()
    grads = {"hidden": hidden_SBH.grad}
    # in Megatron's DDP the gradient is in the fp32 main_grad buffer (zero before this one call)
    grads.update({n: p.grad if p.grad is not None else getattr(p, "main_grad", None)
                  for n, p in layer.named_parameters()})
    return out_SBH.detach(), grads


def _detected(layer, hidden_SBH, grad_SBH, padding_mask_BS=None):
    with HostSyncDetector() as detector:
        result = _layer_call(layer, hidden_SBH, grad_SBH, padding_mask_BS)
    return result, [(e.what, e.where) for e in detector.events]


def _dispatched(layer, hidden_SBH):
    """What the layer's dispatcher hands the experts: tokens, counts per expert, probs, token of each copy."""
    dispatcher = layer.token_dispatcher
    with torch.no_grad():
        probs_NE, routing_NE = layer.router(hidden_SBH)
        tokens_PH, probs_P = dispatcher.dispatch_preprocess(hidden_SBH, routing_NE, probs_NE)
        tokens_PH, probs_P = dispatcher.token_dispatch(tokens_PH, probs_P)
        token_of_copy_P = dispatcher.reversed_local_input_permutation_mapping
        tokens_PH, counts_E, probs_P = dispatcher.dispatch_postprocess(tokens_PH, probs_P)
    return {"tokens": tokens_PH, "counts": torch.as_tensor(counts_E), "probs": probs_P,
            "token_of_copy": token_of_copy_P,
            "counts_on_device": getattr(dispatcher, "_counts_on_device", False)}


def _replayed(model, hidden_SBH, grad_SBH, gen):
    """Layer 0 under moe.routing_replay's replay (R2 / R3 training forward) of distinct random routes."""
    from moe.routing_replay import RoutingReplay

    replay = RoutingReplay(model)
    tokens = SEQ * BATCH
    scores = torch.rand(tokens, replay.spec.num_moe_layers, ARCH.num_experts, generator=gen)
    routes_TLK = scores.topk(ARCH.num_experts_per_tok, dim=-1).indices.to(replay.spec.dtype)
    with replay.replaying(routes_TLK, validate=False):
        return _detected(model.decoder.layers[0].mlp, hidden_SBH, grad_SBH)


def _stand_in_waits():
    """The CPU shim's stand-ins for CUDA streams / events (Megatron's dispatcher waits on them)."""
    with HostSyncDetector() as detector:
        torch.cuda.current_stream().synchronize()
        torch.cuda.Stream().record_event().synchronize()
    return [e.what for e in detector.events]


def _models(build, ModelImplementation, load_full_state_dict):
    """name -> model: Megatron's unmodified dispatcher, the fast one alone and with each other setting the
    layer meets (the models compared share weights), the fast one under Megatron's DDP."""
    impl = lambda **kw: dict(implementation=ModelImplementation(**kw))  # noqa: E731
    models = {"megatron": build(**impl(dispatcher="megatron")), "fast": build(**impl(dispatcher="fast")),
              "fast+recompute": build(**impl(recompute="selective")),
              "fast+sequential": build(**impl(experts="sequential")),
              "fast+replay-idle": build(routing_replay=True),
              # shared experts overlapped with the dispatch: MoELayer hands them to its dispatcher
              "megatron+shared": build(**impl(dispatcher="megatron"), **SHARED),
              "fast+shared": build(**impl(dispatcher="fast"), **SHARED)}
    weights = {}
    for reference, names in (("megatron", [n for n in models if "shared" not in n]),
                             ("megatron+shared", ["fast+shared"])):
        weights[reference] = {n: p.detach().clone() for n, p in models[reference].named_parameters()}
        for name in names:
            load_full_state_dict(models[name], weights[reference])
    return models, weights["megatron"]


def _layer_body(rank, world_size, seed):
    from moe.implementation import ModelImplementation
    from moe.model import build_model
    from moe.optimizer import wrap_data_parallel
    from moe.sharding import load_full_state_dict

    megatron_groups(seed)
    gen = torch.Generator().manual_seed(seed)
    build = lambda **kw: build_model(ARCH, use_transformer_engine=False, **kw)  # noqa: E731
    models, weights = _models(build, ModelImplementation, load_full_state_dict)
    ddp = wrap_data_parallel(build())  # production's layout: experts read DDP's buffers, add into main_grad
    load_full_state_dict(ddp.module, weights)
    hidden_SBH = torch.randn(SEQ, BATCH, ARCH.hidden_size, generator=gen)
    grad_SBH = torch.randn(SEQ, BATCH, ARCH.hidden_size, generator=gen)
    padding_BS = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding_BS[1, -3:] = True
    layer = {name: model.decoder.layers[0].mlp for name, model in models.items()}
    out = {"dispatched": {name: _dispatched(layer[name], hidden_SBH) for name in ("megatron", "fast")}}
    out["calls"] = {name: _detected(layer[name], hidden_SBH, grad_SBH) for name in layer}
    out["calls"]["fast+padding"] = _detected(layer["fast"], hidden_SBH, grad_SBH, padding_BS)
    out["calls"]["megatron+padding"] = _detected(layer["megatron"], hidden_SBH, grad_SBH, padding_BS)
    out["calls"]["fast+ddp"] = _detected(ddp.module.decoder.layers[0].mlp, hidden_SBH, grad_SBH)
    out["calls"]["fast+replaying"] = _replayed(models["fast+replay-idle"], hidden_SBH, grad_SBH, gen)
    out["device_counts"] = {name: l.token_dispatcher.experts_take_device_counts for name, l in layer.items()
                            if name.startswith("fast")}
    out["dispatcher_has_shared_experts"] = {name: l.token_dispatcher.shared_experts is l.shared_experts
                                            for name, l in layer.items() if name.endswith("+shared")}
    out["stand_in_waits"] = _stand_in_waits()
    return out


@pytest.fixture(scope="module")
def layer_runs():
    return run_distributed(_layer_body, world_size=1, args=(11,), timeout_s=240)[0]


def test_moe_layer_forward_and_backward_make_no_host_sync_at_ep1(layer_runs):
    calls = layer_runs["calls"]
    for name in ("fast", "fast+padding", "fast+recompute", "fast+ddp", "fast+replay-idle", "fast+replaying"):
        (_, _), events = calls[name]
        assert events == [], (name, events)
    assert layer_runs["dispatched"]["fast"]["counts_on_device"]


def test_detector_fails_on_megatrons_dispatcher(layer_runs):
    """Megatron's path, unmodified: permute's two masked_selects and the wait for the counts' copy to the host
    (on the CPU the shim's event stand-in; on CUDA `d2h_event.synchronize()`)."""
    assert layer_runs["stand_in_waits"] == ["_CpuStream.synchronize", "_CpuEvent.synchronize"]
    for name in ("megatron", "megatron+padding"):
        (_, _), events = layer_runs["calls"][name]
        seen = [(what, where.split(" <- ")[0]) for what, where in events]
        assert sum(what == "aten.masked_select" and "moe_utils.py" in where and "permute" in where
                   for what, where in seen) == 2, seen
        assert any(what == "_CpuEvent.synchronize" and "_maybe_dtoh_and_synchronize" in where
                   for what, where in seen), seen


def test_experts_that_need_host_counts_keep_megatrons_path(layer_runs):
    """SequentialMLP calls .tolist() on the counts: the fast dispatcher hands it Megatron's host counts (and
    so keeps Megatron's wait for them)."""
    assert layer_runs["device_counts"] == {"fast": True, "fast+recompute": True, "fast+sequential": False,
                                           "fast+replay-idle": True, "fast+shared": True}
    (_, _), events = layer_runs["calls"]["fast+sequential"]
    assert any(what == "_CpuEvent.synchronize" for what, _ in events), events


def test_overlapped_shared_experts_reach_the_fast_dispatcher(layer_runs):
    """MoELayer gives overlapped shared experts to the dispatcher it builds; FastDispatchMoELayer replaces that
    dispatcher and hands them on (without, the layer silently dropped their output and gradient). Their path is
    Megatron's own (compared bit for bit in the next test)."""
    assert layer_runs["dispatcher_has_shared_experts"] == {"megatron+shared": True, "fast+shared": True}


def test_on_device_dispatch_equals_megatron_bit_for_bit(layer_runs):
    fast, megatron = layer_runs["dispatched"]["fast"], layer_runs["dispatched"]["megatron"]
    assert fast["counts_on_device"] and not megatron["counts_on_device"]
    for key in ("tokens", "counts", "probs", "token_of_copy"):
        assert fast[key].dtype == megatron[key].dtype and torch.equal(fast[key], megatron[key]), key
    calls = layer_runs["calls"]
    for ours, theirs in (("fast", "megatron"), ("fast+padding", "megatron+padding"), ("fast+ddp", "megatron"),
                         ("fast+recompute", "megatron"), ("fast+shared", "megatron+shared")):
        (out, grads), _ = calls[ours]
        (ref_out, ref_grads), _ = calls[theirs]
        assert torch.equal(out, ref_out), ours
        assert set(grads) == set(ref_grads) and len(grads) > 2
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), (ours, name)


# ---- CUDA: the driver's own check ----------------------------------------------------------------------------


def _cuda_body(rank, world_size, seed):
    from moe.implementation import ModelImplementation
    from moe.model import build_model
    from moe.sharding import load_full_state_dict

    megatron_groups(seed)
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    models = {d: build_model(ARCH, params_dtype=torch.bfloat16, use_transformer_engine=False,
                             implementation=ModelImplementation(dispatcher=d)) for d in ("megatron", "fast")}
    weights = {n: p.detach().clone() for n, p in models["megatron"].named_parameters()}
    load_full_state_dict(models["fast"], weights)
    layer = {d: m.decoder.layers[0].mlp for d, m in models.items()}
    hidden_SBH = torch.randn(SEQ, BATCH, ARCH.hidden_size, generator=gen).to(device, torch.bfloat16)
    grad_SBH = torch.randn(SEQ, BATCH, ARCH.hidden_size, generator=gen).to(device)
    out = {}
    for d in ("megatron", "fast"):
        _layer_call(layer[d], hidden_SBH, grad_SBH)  # first calls: lazy CUDA / cuBLAS initialisation
        out[d] = _layer_call(layer[d], hidden_SBH, grad_SBH)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out["fast_checked"], out["fast_events"] = _detected(layer["fast"], hidden_SBH, grad_SBH)
        try:
            _layer_call(layer["megatron"], hidden_SBH, grad_SBH)
            out["megatron_error"] = None
        except RuntimeError as exc:  # the check can fail: Megatron's masked_select synchronises
            out["megatron_error"] = str(exc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out["counts_on_device"] = layer["fast"].token_dispatcher.experts_take_device_counts
    return out


@pytest.mark.gpu
def test_moe_layer_on_cuda_makes_no_sync_under_sync_debug_mode_and_matches_megatron():
    """bf16, one MoE layer fwd + bwd of the fast dispatcher under torch.cuda.set_sync_debug_mode("error") (any
    synchronising CUDA call raises), against Megatron's path. Tolerance: the experts see the same tokens, so
    expert and router gradients are expected identical; the layer output and its input gradient differ by the
    sums of each token's k copies (one float32 reduction rounded once, against scatter_add / index_add rounding
    in bf16 after each of k adds, in any order): k bf16 roundings of the largest value."""
    out = run_distributed(_cuda_body, world_size=1, args=(5,), timeout_s=300, env=cuda_env())[0]
    assert out["counts_on_device"] and out["fast_events"] == [], out["fast_events"]
    assert out["megatron_error"] is not None and "synchronizing" in out["megatron_error"]
    (got, grads), (ref, ref_grads) = out["fast_checked"], out["megatron"]
    assert torch.equal(out["fast"][0], got)  # the checked call computed what the unchecked one did
    k = ARCH.num_experts_per_tok
    for what, actual, expected in [("output", got, ref)] + [(n, grads[n], g) for n, g in ref_grads.items()]:
        scale = float(expected.abs().max())
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=k * 2 ** -8 * scale,
                                   msg=lambda m, what=what: f"{what}: {m}")
