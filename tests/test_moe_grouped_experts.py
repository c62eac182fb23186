"""Grouped-GEMM experts (moe.experts.GroupedGemmExperts, `model.experts=grouped`) compute what Megatron's
SequentialMLP computes: forward and every gradient (tokens, router weights, each expert's fc1 / fc2), with
uneven and empty experts, in one process, at EP=2 and at expert-TP=2; same parameter names, so the same
checkpoints load. In Megatron's DDP (distributed-optimizer buffers) the per-expert weights are read as one
[E, N, K] view of the parameter buffer with no stack / cat copy, and the main_grads the DDP hooks accumulate
equal SequentialMLP's.

Tolerances. float32: both paths are float32 GEMMs over the same rows, differing only in summation order:
rtol 1e-5, atol 2e-6 * max|reference| + 1e-7 (as tests/test_megatron_cpu.py). bfloat16: the error of each
path against the float32 reference on the same (bf16-rounded) weights; the grouped path's error may be at most
2x SequentialMLP's own bf16 error plus one bf16 ulp of the largest value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from devices import megatron_groups
from helpers import scaled_close, tiny_arch
from multiprocess import run_distributed

CUDA_ENV = {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}

ARCH = tiny_arch("moe", vocab_size=64, num_experts=6, router_aux_loss_coef=0.01)
# an empty expert first, one in the middle, one token alone, uneven counts: T = 16
TOKENS_PER_EXPERT = [0, 5, 3, 0, 1, 7]
RTOL, ATOL_SCALE = 1e-5, 2e-6
_close = scaled_close(rtol=RTOL, atol_scale=ATOL_SCALE)


def _experts_call(experts, hidden_TH, probs_T, grad_TH):
    """Output and gradients of one experts module on fixed permuted tokens."""
    device = next(experts.parameters()).device
    hidden_TH = hidden_TH.to(device).clone().requires_grad_(True)
    probs_T = probs_T.to(device).clone().requires_grad_(True)
    grad_TH = grad_TH.to(device)
    experts.zero_grad(set_to_none=True)
    out_TH, bias = experts(hidden_TH, torch.tensor(TOKENS_PER_EXPERT), probs_T)
    assert bias is None
    (out_TH.float() * grad_TH).sum().backward()
    grads = {"tokens": hidden_TH.grad, "probs": probs_T.grad}
    grads.update({n: p.grad for n, p in experts.named_parameters()})
    return out_TH.detach(), grads


def _single_process_body(rank, world_size, seed):
    from moe.implementation import ImplementationError, ModelImplementation
    from moe.model import build_model as build_any_model
    from moe.model import forward_logits
    from moe.sharding import load_full_state_dict

    def build_model(*args, **kwargs):  # our paths also where Transformer Engine is installed
        return build_any_model(*args, use_transformer_engine=False, **kwargs)

    megatron_groups(seed)  # the CPU shim does nothing on a GPU host
    arch = ARCH
    gen = torch.Generator().manual_seed(seed)
    sequential = ModelImplementation(experts="sequential")
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        for impl in (sequential, ModelImplementation(experts="grouped")):
            models[(impl.experts, dtype)] = build_model(arch, params_dtype=dtype, implementation=impl)
    full = {n: p.detach().clone() for n, p in models[("sequential", torch.float32)].named_parameters()}
    full_bf16 = {n: t.bfloat16() for n, t in full.items()}
    for (_, dtype), model in models.items():
        load_full_state_dict(model, full if dtype == torch.float32 else full_bf16)
    # the fp32 reference of the bf16 runs holds the bf16-rounded weights
    reference_bf16_weights = build_model(arch, implementation=sequential)
    load_full_state_dict(reference_bf16_weights, {n: t.float() for n, t in full_bf16.items()})

    out = {"types": {k: type(m.decoder.layers[0].mlp.experts).__name__ for k, m in models.items()},
           "names": {k: sorted(n for n, _ in m.named_parameters()) for k, m in models.items()},
           # what Megatron's dist_checkpointing writes: key -> (global shape, global offset, replica id)
           "sharded": {k: {key: (tuple(t.global_shape), tuple(t.global_offset), tuple(t.replica_id))
                           for key, t in m.sharded_state_dict().items() if hasattr(t, "global_shape")}
                       for k, m in models.items()}}
    num_tokens = sum(TOKENS_PER_EXPERT)
    hidden_TH = torch.randn(num_tokens, arch.hidden_size, generator=gen)
    probs_T = torch.rand(num_tokens, generator=gen)
    grad_TH = torch.randn(num_tokens, arch.hidden_size, generator=gen)
    experts_of = lambda model: model.decoder.layers[0].mlp.experts  # noqa: E731
    for key, model in models.items():
        dtype = key[1]
        out[("module", *key)] = _experts_call(experts_of(model), hidden_TH.to(dtype), probs_T, grad_TH)
    out["module_bf16_reference"] = _experts_call(experts_of(reference_bf16_weights), hidden_TH.bfloat16().float(),
                                                 probs_T, grad_TH)

    # the whole model: routing decides the (uneven, possibly empty) expert loads
    tokens_BS = torch.randint(0, arch.vocab_size, (3, 10), generator=gen)
    for key in (("sequential", torch.float32), ("grouped", torch.float32)):
        model = models[key]
        model.zero_grad(set_to_none=True)
        logits = forward_logits(model, tokens_BS.to(next(model.parameters()).device))
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed + 1)).to(logits.device)
        (logits * weights).sum().backward()
        out[("model", *key)] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})

    # torch grouped_mm needs 16-byte rows: an expert width of 6 float32 (24 B) is refused at build time
    odd = dataclasses.replace(ARCH, moe_intermediate_size=6)
    try:
        build_model(odd)
        out["odd_error"] = None
    except ImplementationError as exc:
        out["odd_error"] = str(exc)
    out["odd_sequential_builds"] = build_model(odd, implementation=sequential) is not None
    return out


@pytest.fixture(scope="module")
def single_process():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return seed, run_distributed(_single_process_body, world_size=1, args=(seed,), timeout_s=240)[0]


def test_grouped_is_the_default_and_keeps_sequential_parameter_names(single_process):
    _, out = single_process
    assert out["types"][("grouped", torch.float32)] == "GroupedGemmExperts"
    assert out["types"][("sequential", torch.float32)] == "SequentialMLP"
    names = out["names"][("grouped", torch.float32)]
    assert names == out["names"][("sequential", torch.float32)]
    assert "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight" in names
    # the same distributed-checkpoint tensors (keys, global shapes, offsets, replicas): checkpoints interchange
    sharded = out["sharded"][("grouped", torch.float32)]
    assert sharded == out["sharded"][("sequential", torch.float32)]
    assert any("experts" in key for key in sharded)


def test_grouped_experts_equal_sequential_in_float32_with_empty_experts(single_process):
    seed, out = single_process
    ref_out, ref_grads = out[("module", "sequential", torch.float32)]
    got_out, got_grads = out[("module", "grouped", torch.float32)]
    _close(got_out, ref_out, f"seed {seed} experts output")
    assert set(got_grads) == set(ref_grads) and len(ref_grads) == 2 + 2 * len(TOKENS_PER_EXPERT)
    for name, expected in ref_grads.items():
        _close(got_grads[name], expected, f"seed {seed} grad {name}")
    for e, count in enumerate(TOKENS_PER_EXPERT):  # an empty expert's gradient is exactly zero, not missing
        fc1 = got_grads[f"local_experts.{e}.linear_fc1.weight"]
        assert (fc1.abs().max() == 0) == (count == 0), (e, count)


def test_grouped_experts_bf16_error_is_within_twice_sequential(single_process):
    seed, out = single_process
    ref_out, ref_grads = out["module_bf16_reference"]
    seq_out, seq_grads = out[("module", "sequential", torch.bfloat16)]
    got_out, got_grads = out[("module", "grouped", torch.bfloat16)]
    pairs = [("output", got_out, seq_out, ref_out)] + [
        (name, got_grads[name], seq_grads[name], ref_grads[name]) for name in ref_grads]
    for name, got, seq, ref in pairs:
        ulp = 2.0**-8 * float(ref.abs().max())
        got_err = float((got.float() - ref.float()).abs().max())
        seq_err = float((seq.float() - ref.float()).abs().max())
        assert got_err <= 2 * seq_err + ulp, f"seed {seed} {name}: grouped {got_err:.3g} vs sequential {seq_err:.3g}"


def test_whole_model_grouped_equals_sequential(single_process):
    seed, out = single_process
    ref_logits, ref_grads = out[("model", "sequential", torch.float32)]
    logits, grads = out[("model", "grouped", torch.float32)]
    _close(logits, ref_logits, f"seed {seed} logits")
    for name, expected in ref_grads.items():
        _close(grads[name], expected, f"seed {seed} grad {name}")


def test_misaligned_expert_width_is_refused_naming_the_key(single_process):
    _, out = single_process
    assert out["odd_error"] is not None and "model.experts" in out["odd_error"]
    assert "6 x 4 B" in out["odd_error"]
    assert out["odd_sequential_builds"]


def _parallel_body(rank, world_size, layout_kwargs, seed):
    from test_megatron_cpu import _loss_and_grads

    from moe.implementation import ModelImplementation
    from moe.model import build_model
    from moe.parallel import destroy_model_parallel
    from moe.sharding import local_view_of_full, load_full_state_dict

    # aux loss off: its load statistics are per data-parallel rank, so it differs from one process by design
    arch = dataclasses.replace(ARCH, num_experts=8, router_aux_loss_coef=0.0)
    tokens_BS = torch.randint(0, arch.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))
    num_tokens = 4 * 8
    megatron_groups(seed)
    reference = build_model(arch, implementation=ModelImplementation(experts="sequential"))
    full = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_loss, ref_grads = _loss_and_grads(reference, tokens_BS, num_tokens, dp_group_reduce=False)
    del reference
    destroy_model_parallel()

    layout = megatron_groups(seed, **layout_kwargs)
    from megatron.core import parallel_state as ps

    model = build_model(arch, layout, implementation=ModelImplementation(experts="grouped"))
    load_full_state_dict(model, full)
    experts_type = type(model.decoder.layers[0].mlp.experts).__name__
    rows = 4 // ps.get_data_parallel_world_size()
    start = ps.get_data_parallel_rank() * rows
    import moe.experts as experts_module

    experts_module.STACK_FALLBACKS.clear()
    loss, grads = _loss_and_grads(model, tokens_BS[start:start + rows], num_tokens, dp_group_reduce=True)
    expected = local_view_of_full(model, ref_grads)
    destroy_model_parallel()
    return (experts_type, dict(experts_module.STACK_FALLBACKS)), (loss, ref_loss), {
        n: (g, expected[n]) for n, g in grads.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [dict(expert_parallel=2), dict(tensor_parallel=2, expert_tensor_parallel=2)],
                         ids=["ep2", "tp2_etp2"])
def test_grouped_experts_in_parallel_layouts_equal_single_process_sequential(layout):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for rank, ((experts_type, stack_fallbacks), (loss, ref_loss), grads) in enumerate(
            run_distributed(_parallel_body, world_size=2, args=(layout, seed), timeout_s=240)):
        assert experts_type == "GroupedGemmExperts"
        assert stack_fallbacks == {}  # in DDP: the [E, N, K] views of the parameter buffer, no stacked copy
        _close(loss, ref_loss, f"seed {seed} rank {rank} loss")
        assert any("local_experts" in n for n in grads)
        for name, (grad, expected) in grads.items():
            _close(grad, expected, f"seed {seed} rank {rank} grad {name}")


@pytest.mark.gpu
def test_grouped_experts_equal_sequential_on_cuda():
    """The same checks on a GPU: bf16 runs torch's grouped GEMM kernel (sm90+), fp32 its per-group fallback."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    result = (seed, run_distributed(_single_process_body, world_size=1, args=(seed,), timeout_s=300, env=CUDA_ENV)[0])
    test_grouped_is_the_default_and_keeps_sequential_parameter_names(result)
    test_grouped_experts_equal_sequential_in_float32_with_empty_experts(result)
    test_grouped_experts_bf16_error_is_within_twice_sequential(result)
    test_whole_model_grouped_equals_sequential(result)
    test_misaligned_expert_width_is_refused_naming_the_key(result)


# ---- the expert weights as one [E, N, K] view of Megatron DDP's parameter buffer (no stacked copy) ----------------


def _count_stack_ops():
    """A dispatch mode recording every stack / cat whose result has the shape of stacked expert weights
    [E, N, K] (SwiGLU's chunk backward is a cat too, of activations: [T, F])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__ if hasattr(func, "__name__") else str(func)
            result = func(*args, **(kwargs or {}))
            if name.split(".")[0] in ("stack", "cat", "_cat") and result.dim() == 3 \
                    and result.shape[0] == ARCH.num_experts:
                self.copies.append((str(func), tuple(result.shape)))
            return result

    return _Recorder()


def _ddp_body(rank, world_size, seed, wgrad="auto", activation="torch"):
    """Sequential and grouped experts, both in Megatron's DDP (distributed optimizer layout), float32 and
    bfloat16: outputs, token / router-weight gradients and every expert's main_grad (what the DDP hooks
    accumulated), plus what the grouped path did with the weights. `wgrad`: the grouped experts' weight-
    gradient accumulation (moe.experts.WGRAD_ACCUMULATIONS); `activation`: their SwiGLU x probability."""
    import moe.experts as experts_module
    from moe.implementation import ModelImplementation
    from moe.model import build_model as build_any_model
    from moe.optimizer import wrap_data_parallel
    from moe.sharding import load_full_state_dict

    megatron_groups(seed)  # the CPU shim does nothing on a GPU host
    arch = ARCH
    gen = torch.Generator().manual_seed(seed)
    build = lambda impl, dtype=torch.float32: build_any_model(  # noqa: E731
        arch, params_dtype=dtype, implementation=ModelImplementation(experts=impl, expert_wgrad=wgrad,
                                                                     expert_activation=activation),
        use_transformer_engine=False)
    full = {n: p.detach().clone() for n, p in build("sequential").named_parameters()}
    full_bf16 = {n: t.bfloat16() for n, t in full.items()}
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        for impl in ("sequential", "grouped"):
            model = build(impl, dtype)
            load_full_state_dict(model, full if dtype == torch.float32 else full_bf16)
            models[(impl, dtype)] = (model, wrap_data_parallel(model))
    reference_bf16 = build("sequential")  # fp32 math on the bf16-rounded weights
    load_full_state_dict(reference_bf16, {n: t.float() for n, t in full_bf16.items()})
    reference_bf16_ddp = wrap_data_parallel(reference_bf16)

    grouped = models[("grouped", torch.float32)][0]
    out = {"registration": [n for n, _ in grouped.decoder.layers[0].mlp.experts.named_parameters()],
           "iteration": [id(e) for e in grouped.decoder.layers[0].mlp.experts.local_experts],
           "indexing": [id(grouped.decoder.layers[0].mlp.experts.local_experts[e])
                        for e in range(ARCH.num_experts)],
           "views": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for layer in models[("grouped", dtype)][0].decoder.layers:
            experts = list(layer.mlp.experts.local_experts)
            for fc in ("linear_fc1", "linear_fc2"):
                weights = [getattr(e, fc).weight for e in experts]
                view = experts_module.expert_weights_ENK(weights)
                out["views"][(str(dtype), layer.layer_number, fc)] = (
                    view is not None and view.data_ptr() == weights[0].data_ptr()
                    and all(torch.equal(view[e], w) for e, w in enumerate(weights)))

    num_tokens = sum(TOKENS_PER_EXPERT)
    hidden_TH = torch.randn(num_tokens, arch.hidden_size, generator=gen)
    probs_T = torch.rand(num_tokens, generator=gen)
    grad_TH = torch.randn(num_tokens, arch.hidden_size, generator=gen)

    def call(model, ddp, dtype, record=None):
        experts = model.decoder.layers[0].mlp.experts
        device = next(experts.parameters()).device
        h = hidden_TH.to(device, dtype).clone().requires_grad_(True)
        p = probs_T.to(device).clone().requires_grad_(True)
        ddp.zero_grad_buffer()
        with record if record is not None else contextlib.nullcontext():
            out_TH, _ = experts(h, torch.tensor(TOKENS_PER_EXPERT), p)
            (out_TH.float() * grad_TH.to(device)).sum().backward()
        grads = {"tokens": h.grad, "probs": p.grad}
        grads.update({n: prm.main_grad.clone() for n, prm in experts.named_parameters()})
        assert all(prm.grad is None for prm in experts.parameters())  # the DDP hooks moved them into main_grad
        grads["added_flags"] = {n: bool(prm.grad_added_to_main_grad) for n, prm in experts.named_parameters()}
        return out_TH.detach(), grads

    experts_module.STACK_FALLBACKS.clear()
    recorder = _count_stack_ops()
    for key, (model, ddp) in models.items():
        out[key] = call(model, ddp, key[1], recorder if key[0] == "grouped" else None)
    out["reference_bf16"] = call(reference_bf16, reference_bf16_ddp, torch.float32)
    # a second micro-batch without zeroing: the one-add path accumulates like the hooks do (2 x the first)
    model, ddp = models[("grouped", torch.float32)]
    experts = model.decoder.layers[0].mlp.experts
    device = next(experts.parameters()).device
    h = hidden_TH.to(device).requires_grad_(True)
    ddp.zero_grad_buffer()
    for _ in range(2):
        o, _ = experts(h, torch.tensor(TOKENS_PER_EXPERT), probs_T.to(device))
        (o * grad_TH.to(device)).sum().backward()
    out["twice"] = {n: prm.main_grad.clone() for n, prm in experts.named_parameters()}
    out["stack_fallbacks"] = dict(experts_module.STACK_FALLBACKS)
    out["copies"] = recorder.copies
    return out


@pytest.fixture(scope="module")
def ddp_process():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return seed, run_distributed(_ddp_body, world_size=1, args=(seed,), timeout_s=240)[0]


def test_experts_register_last_to_first_but_index_and_iterate_in_order(ddp_process):
    _, out = ddp_process
    e = ARCH.num_experts
    assert out["registration"][:2] == [f"local_experts.{e - 1}.linear_fc1.weight",
                                       f"local_experts.{e - 1}.linear_fc2.weight"]
    assert out["registration"][-1] == "local_experts.0.linear_fc2.weight"
    assert out["iteration"] == out["indexing"]


def test_ddp_wrapped_expert_weights_are_one_zero_copy_view(ddp_process):
    """After Megatron's DDP re-points the parameters into its buffer, every MoE layer's fc1 and fc2 weights
    are read as one [E, N, K] view starting at expert 0's data: no stack fallback, no stack / cat op in the
    grouped experts' forward + backward (the stacking code made 4 per call)."""
    _, out = ddp_process
    assert out["views"] and all(out["views"].values()), out["views"]
    assert out["stack_fallbacks"] == {}
    assert out["copies"] == []


def test_ddp_wrapped_grouped_experts_equal_sequential_float32(ddp_process):
    seed, out = ddp_process
    ref_out, ref_grads = out[("sequential", torch.float32)]
    got_out, got_grads = out[("grouped", torch.float32)]
    _close(got_out, ref_out, f"seed {seed} experts output")
    assert set(got_grads) == set(ref_grads) and len(ref_grads) == 3 + 2 * len(TOKENS_PER_EXPERT)
    ref_grads, got_grads = dict(ref_grads), dict(got_grads)
    assert not any(ref_grads.pop("added_flags").values())  # SequentialMLP: every gradient through the hooks
    # grouped: all experts' gradients added into main_grad by one add; the hooks were told so (no double add)
    assert all(got_grads.pop("added_flags").values())
    for name, expected in ref_grads.items():
        _close(got_grads[name], expected, f"seed {seed} main_grad {name}")
    for e, count in enumerate(TOKENS_PER_EXPERT):  # an empty expert's main_grad stays exactly zero
        assert (got_grads[f"local_experts.{e}.linear_fc1.weight"].abs().max() == 0) == (count == 0), (e, count)


def test_ddp_wrapped_grouped_experts_accumulate_micro_batches_in_main_grad(ddp_process):
    """Two micro-batches without zeroing the buffer: main_grad holds twice one micro-batch's gradient (exactly:
    the same bits added twice), as Megatron's hooks would have accumulated it."""
    seed, out = ddp_process
    _, once = out[("grouped", torch.float32)]
    for name, twice in out["twice"].items():
        assert torch.equal(twice, 2 * once[name]), (seed, name)


def test_ddp_wrapped_grouped_experts_bf16_error_is_within_twice_sequential(ddp_process):
    seed, out = ddp_process
    ref_out, ref_grads = out["reference_bf16"]
    seq_out, seq_grads = out[("sequential", torch.bfloat16)]
    got_out, got_grads = out[("grouped", torch.bfloat16)]
    pairs = [("output", got_out, seq_out, ref_out)] + [
        (name, got_grads[name], seq_grads[name], ref_grads[name]) for name in ref_grads if name != "added_flags"]
    for name, got, seq, ref in pairs:
        ulp = 2.0**-8 * float(ref.abs().max())
        got_err = float((got.float() - ref.float()).abs().max())
        seq_err = float((seq.float() - ref.float()).abs().max())
        assert got_err <= 2 * seq_err + ulp, f"seed {seed} {name}: grouped {got_err:.3g} vs sequential {seq_err:.3g}"


def test_expert_weight_view_needs_equal_ascending_aligned_spacing():
    from moe.experts import expert_weights_ENK

    buffer = torch.randn(1000)
    ascending = [buffer[10 * 0 + 8 + 40 * e:8 + 40 * e + 24].view(4, 6) for e in range(3)]  # stride 40 = 160 B
    view = expert_weights_ENK(ascending)
    assert view is not None and view.data_ptr() == ascending[0].data_ptr()
    assert torch.equal(view, torch.stack(ascending))
    assert expert_weights_ENK(ascending[::-1]) is None  # descending: no strided view can read it
    assert expert_weights_ENK([ascending[0], ascending[1], buffer[100:124].view(4, 6)]) is None  # unequal
    assert expert_weights_ENK([buffer[1 + 40 * e:1 + 40 * e + 24].view(4, 6) for e in range(3)]) is None  # 4 B off
    assert expert_weights_ENK([buffer[8 + 20 * e:8 + 20 * e + 24].view(4, 6) for e in range(3)]) is None  # overlap
    assert expert_weights_ENK([torch.randn(4, 6) for _ in range(3)]) is None  # separate tensors
    assert expert_weights_ENK([t.t() for t in (buffer[:24].view(6, 4),)]) is None  # not row-major


def test_expert_offsets_are_int32_cumulative_ends_on_the_device():
    from moe.experts import expert_offsets

    expected = torch.tensor([0, 5, 8, 8, 9, 16], dtype=torch.int32)
    for counts in (TOKENS_PER_EXPERT, torch.tensor(TOKENS_PER_EXPERT), torch.tensor(TOKENS_PER_EXPERT).numpy()):
        offs = expert_offsets(counts, torch.device("cpu"))
        assert offs.dtype == torch.int32 and torch.equal(offs, expected)
    if torch.cuda.is_available():
        for counts in (TOKENS_PER_EXPERT, torch.tensor(TOKENS_PER_EXPERT), torch.tensor(TOKENS_PER_EXPERT).cuda()):
            offs = expert_offsets(counts, torch.device("cuda", torch.cuda.current_device()))
            assert offs.is_cuda and offs.dtype == torch.int32 and torch.equal(offs.cpu(), expected)


def _ddp_checks(result):
    test_experts_register_last_to_first_but_index_and_iterate_in_order(result)
    test_ddp_wrapped_expert_weights_are_one_zero_copy_view(result)
    test_ddp_wrapped_grouped_experts_equal_sequential_float32(result)
    test_ddp_wrapped_grouped_experts_accumulate_micro_batches_in_main_grad(result)
    test_ddp_wrapped_grouped_experts_bf16_error_is_within_twice_sequential(result)


def test_ddp_wrapped_grouped_experts_with_foreach_accumulation():
    """The multi-tensor add of the per-expert gradients into main_grad: the same checks as the default."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    _ddp_checks((seed, run_distributed(_ddp_body, world_size=1, args=(seed, "foreach"), timeout_s=240)[0]))


def test_addmm_accumulation_needs_cuda():
    from moe.experts import _WgradPlan
    from moe.implementation import ImplementationError

    with pytest.raises(ImplementationError, match="'addmm' needs CUDA"):
        _WgradPlan("addmm", [1, 2], torch.device("cpu"))
    assert _WgradPlan("auto", [1, 2], torch.device("cpu")).mode == "add"
    assert _WgradPlan("auto", [1, 2], torch.device("cuda")).mode == "add"  # addmm measured slower (moe.experts)
    with pytest.raises(ImplementationError, match="model.expert_wgrad must be one of"):
        from moe.implementation import ModelImplementation

        ModelImplementation(expert_wgrad="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad,activation", [("auto", "torch"), ("foreach", "torch"), ("addmm", "torch"),
                                               ("triton", "fused")])
def test_ddp_wrapped_grouped_experts_on_cuda(wgrad, activation):
    """The DDP checks on a GPU: the bf16 grouped GEMM kernel (sm90+) reads the strided [E, N, K] view of the
    parameter buffer (an expert stride larger than N K); fp32 its per-group fallback; each accumulation mode
    (`addmm`: per-expert cuBLAS GEMMs accumulating in place into the fp32 main_grad; `triton`: one grouped
    Triton GEMM adding into it, here with the fused Triton SwiGLU x probability, moe.triton_*)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    _ddp_checks((seed, run_distributed(_ddp_body, world_size=1, args=(seed, wgrad, activation), timeout_s=300,
                                       env=CUDA_ENV)[0]))
