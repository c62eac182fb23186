"""Fused token log-prob kernels (megagspo._C) against the pure-torch references.

Legend: T tokens, V vocab (shard). Fresh random inputs on every run (no fixed seed); the seed is printed
in assertion messages so that a failure can be replayed.

Tolerance: a fused result must be within 2x the error of a same-precision torch run (both against a float64
reference) plus the (atol, rtol) floor of TOL below (docs/architecture.md, "Where the choices come from").
"""

from __future__ import annotations

import warnings

import pytest
import torch

import megagspo.kernels as K
from helpers import reseed_torch
from megagspo.kernels import reference as R
from multiprocess import run_distributed

# dtype -> (atol, rtol): the floor added to "2x the same-precision torch error".
TOL = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (2e-6, 2e-6),
    torch.bfloat16: (2e-6, 2e-6),  # outputs are float32 from bf16 inputs; gradients are bf16 (rounding below)
    torch.float16: (2e-6, 2e-6),
}

pytestmark = pytest.mark.skipif(not K.fused_available("cpu"), reason="megagspo._C not built (make ext)")


SHAPES = [(1, 7), (5, 7), (3, 1000), (4, 4099), (2, 151_936)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _inputs(T, V, dtype, scale=3.0):
    logits = (torch.randn(T, V, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, V, (T,))
    return logits, target


def _torch_same_precision(logits, target, g_lp, g_h):
    """Plain torch in the input precision (what a user would write without our kernel)."""
    x = logits.detach().clone().requires_grad_()
    lsm = torch.log_softmax(x, -1)
    lp = lsm.gather(1, target[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    (lp.float() * g_lp + ent.float() * g_h).sum().backward()
    return lp.detach().to(torch.float64), ent.detach().to(torch.float64), x.grad.to(torch.float64)


def _fp64_reference(logits, target, g_lp, g_h):
    x = logits.detach().to(torch.float64).requires_grad_()
    lp, ent = K.token_logprobs_ref(x, target, with_entropy=True)
    (lp * g_lp.double() + ent * g_h.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def assert_close_rel(out, ref, same_prec, dtype, what, seed):
    atol, rtol = TOL[dtype]
    out = out.to(torch.float64)
    torch_err = (same_prec - ref).abs().max().item() if same_prec is not None else 0.0
    err = (out - ref).abs()
    bound = 2 * torch_err + atol + rtol * ref.abs()
    worst = (err - bound).max().item()
    assert worst <= 0, (f"{what} ({dtype}): max error {err.max().item():.3e} exceeds 2 x torch error "
                        f"{torch_err:.3e} + atol {atol} + rtol {rtol} (seed {seed})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,V", SHAPES, ids=lambda v: str(v))
def test_forward_backward_matches_reference(T, V, dtype):
    seed = reseed_torch()
    logits, target = _inputs(T, V, dtype)
    g_lp, g_h = torch.randn(T), torch.randn(T)
    x = logits.clone().requires_grad_()
    lp, ent = K.token_logprobs(x, target, with_entropy=True, impl="fused")
    acc = R.acc_dtype(dtype)
    assert lp.dtype == acc and ent.dtype == acc and lp.shape == (T,) and ent.shape == (T,)
    (lp * g_lp.to(acc) + ent * g_h.to(acc)).sum().backward()
    assert x.grad.dtype == dtype
    ref = _fp64_reference(logits, target, g_lp, g_h)
    same = _torch_same_precision(logits, target, g_lp, g_h) if dtype != torch.float64 else (None, None, None)
    assert_close_rel(lp, ref[0], None, dtype, "logp", seed)  # computed in fp32 from the same inputs
    assert_close_rel(ent, ref[1], None, dtype, "entropy", seed)
    assert_close_rel(x.grad, ref[2], same[2], dtype, "d logits", seed)
    assert (lp <= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logp_only_and_inplace_backward(dtype):
    seed = reseed_torch()
    T, V = 6, 2053
    logits, target = _inputs(T, V, dtype)
    g = torch.randn(T)
    x1 = logits.clone().requires_grad_()
    K.token_logprobs(x1, target, impl="fused").mul(g).sum().backward()

    h = logits.clone().requires_grad_()
    x2 = h * 1.0  # an intermediate: in-place gradient mode overwrites it
    lp = K.token_logprobs(x2, target, inplace_backward=True, impl="fused")
    lp.mul(g).sum().backward()
    assert torch.equal(h.grad, x1.grad), f"in-place gradient differs (seed {seed})"
    assert torch.equal(x2.detach(), x1.grad), "in-place mode must leave d logits in the logits buffer"


def test_inplace_backward_refuses_leaf_and_detects_other_users():
    logits, target = _inputs(3, 11, torch.float32)
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf"):
        K.token_logprobs(leaf, target, inplace_backward=True, impl="fused")
    # exp() saves its output for backward: overwriting that output must not pass silently.
    h = logits.clone().requires_grad_()
    x = h.exp()
    loss = K.token_logprobs(x, target, inplace_backward=True, impl="fused").sum() + x.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_logprobs_never_positive():
    reseed_torch()
    T, V = 64, 4099
    x = torch.full((T, V), -30.0)
    target = torch.randint(0, V, (T,))
    x[torch.arange(T), target] = 40.0 + torch.rand(T) * 40  # near-certain targets: log p rounds around 0
    x += torch.randn(T, V) * 1e-3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lp = K.token_logprobs(x.to(dtype), target, impl="fused")
        assert (lp <= 0).all(), f"positive log-prob {lp.max().item()} for {dtype}"
    lp, _, _ = torch.ops.megagspo.logprob_forward(x, target, False, False)
    assert lp.max().item() <= 0.0


def test_neg_inf_logits_and_int32_targets():
    seed = reseed_torch()
    T, V = 4, 3001
    logits, target = _inputs(T, V, torch.float32)
    logits[:, ::7] = float("-inf")
    target = torch.where(target % 7 == 0, target + 1, target).clamp(max=V - 1)
    g_lp, g_h = torch.randn(T), torch.randn(T)
    x = logits.clone().requires_grad_()
    lp, ent = K.token_logprobs(x, target.to(torch.int32), with_entropy=True, impl="fused")
    (lp * g_lp + ent * g_h).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
    ref = _fp64_reference(logits, target, g_lp, g_h)
    assert_close_rel(lp, ref[0], None, torch.float32, "logp", seed)
    assert_close_rel(ent, ref[1], None, torch.float32, "entropy", seed)
    assert_close_rel(x.grad, ref[2], None, torch.float32, "d logits", seed)
    assert (x.grad[:, ::7] == 0).all()


def test_strided_rows():
    seed = reseed_torch()
    big, target = _inputs(5, 3000, torch.float32)
    view = big[:, 100:2077]  # rows strided by 3000, vocab contiguous
    target = target % 1977
    x = view.clone()
    assert torch.allclose(K.token_logprobs(view, target, impl="fused"), K.token_logprobs(x, target, impl="fused"))
    ref = R.token_logprobs_ref(view.double(), target)
    assert_close_rel(K.token_logprobs(view, target, impl="fused"), ref, None, torch.float32, "logp", seed)
    col = big.t().contiguous().t()[:, :7]  # vocab stride != 1: the wrapper makes it contiguous
    assert torch.allclose(K.token_logprobs(col, target % 7, impl="fused"), R.token_logprobs_ref(col, target % 7))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64(with_entropy):
    reseed_torch()
    for T, V in [(1, 7), (3, 19)]:
        logits, target = _inputs(T, V, torch.float64, scale=2.0)
        x = logits.clone().requires_grad_()

        def fn(x):
            return K.token_logprobs(x * 1.0, target, with_entropy=with_entropy, impl="fused")

        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_inplace_backward_runs_once():
    """The in-place mode consumes the logits: a second backward through the same graph must fail loudly
    (which is also why gradcheck, which backpropagates repeatedly, runs on the out-of-place mode)."""
    logits, target = _inputs(2, 9, torch.float64)
    h = logits.clone().requires_grad_()
    lp = K.token_logprobs(h * 1.0, target, inplace_backward=True, impl="fused")
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_input_checks_name_shapes_and_dtypes():
    logits, target = _inputs(3, 11, torch.float32)
    with pytest.raises(RuntimeError, match=r"outside the vocabulary \[0, 11\)"):
        K.token_logprobs(logits, torch.tensor([0, 11, 2]), impl="fused")
    with pytest.raises(RuntimeError, match=r"must be 2-D.*\[3, 11, 1\]"):
        torch.ops.megagspo.logprob_forward(logits[..., None], target, False, False)
    with pytest.raises(RuntimeError, match=r"int64 or int32.*Float"):
        torch.ops.megagspo.logprob_forward(logits, target.float(), False, False)
    with pytest.raises(RuntimeError, match=r"float32, float64, bfloat16 or float16.*Int"):
        torch.ops.megagspo.logprob_forward(logits.int(), target, False, False)
    with pytest.raises(RuntimeError, match=r"grad_logp must be 1-D \[3\]"):
        torch.ops.megagspo.logprob_backward(torch.ones(4), None, logits, target, torch.ones(3), None, 0)
    with pytest.raises(ValueError, match="impl must be one of"):
        K.token_logprobs(logits, target, impl="triton")


def test_every_op_checks_its_arguments_before_it_runs():
    """Each op refuses each bad argument with a RuntimeError naming it (csrc/checks.h), on every build, before
    it allocates or computes anything: a refused in-place backward leaves the logits untouched."""
    ops = torch.ops.megagspo
    logits, target = _inputs(3, 11, torch.float32)
    lp, ent, lse = ops.logprob_forward(logits, target, True, False)
    g = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"target\[1\] = -1 is outside the vocabulary \[0, 11\)"):
        ops.logprob_forward(logits, torch.tensor([0, -1, 2], dtype=torch.int32), False, False)
    with pytest.raises(RuntimeError, match=r"contiguous along vocab.*strides \[1, 3\]"):
        ops.logprob_forward(logits.t().contiguous().t(), target, False, False)
    with pytest.raises(RuntimeError, match="empty vocab dimension"):
        ops.logprob_forward(logits[:, :0], target, False, False)
    with pytest.raises(RuntimeError, match=r"target must be 1-D \[tokens\] matching logits \[3, 11\]"):
        ops.logprob_stats(logits, target[:2], 0, False)
    with pytest.raises(RuntimeError, match="vocab_start must be >= 0; got -1"):
        ops.logprob_stats(logits, target, -1, False)
    with pytest.raises(RuntimeError, match="vocab_start must be >= 0; got -2"):
        ops.logprob_backward(g, None, logits, target, lse, None, -2)
    with pytest.raises(RuntimeError, match=r"lse must be Float.*Double"):
        ops.logprob_backward(g, None, logits, target, lse.double(), None, 0)
    with pytest.raises(RuntimeError, match=r"grad_logp must be contiguous"):
        ops.logprob_backward(torch.ones(6)[::2], None, logits, target, lse, None, 0)
    with pytest.raises(RuntimeError, match="needs both grad_entropy and entropy, or neither; got grad_entropy only"):
        ops.logprob_backward(g, g, logits, target, lse, None, 0)
    with pytest.raises(RuntimeError, match=r"entropy must be 1-D \[3\]"):
        ops.logprob_backward(g, g, logits, target, lse, torch.ones(2), 0)
    x = logits.clone()
    with pytest.raises(RuntimeError, match=r"grad_entropy must be Float"):
        ops.logprob_backward_(x, g, g.double(), target, lse, ent, 0)
    assert torch.equal(x, logits), "a refused in-place backward must leave the logits untouched"
    shared_rows = logits[:1].expand(3, 11)  # every row is the same memory: in-place writes would race
    with pytest.raises(RuntimeError, match="overlap in memory"):
        ops.logprob_backward_(shared_rows, g, None, target, lse, None, 0)


def test_wrappers_refuse_arguments_on_another_device():
    """The Python entry points check devices before choosing a backend (ValueError naming the argument); the
    meta device stands in for a second device on a host without one."""
    logits, target = _inputs(3, 11, torch.float32)
    for impl in ("fused", "reference"):
        with pytest.raises(ValueError, match=r"token_logprobs: target is on meta but logits is on cpu"):
            K.token_logprobs(logits, target.to("meta"), impl=impl)
        with pytest.raises(ValueError, match=r"linear_token_logprobs: weight is on meta but hidden is on cpu"):
            K.linear_token_logprobs(torch.randn(3, 4), torch.randn(11, 4, device="meta"), target, impl=impl)
        with pytest.raises(ValueError, match=r"linear_token_logprobs: target is on meta but hidden is on cpu"):
            K.linear_token_logprobs(torch.randn(3, 4), torch.randn(11, 4), target.to("meta"), impl=impl)


def test_opcheck_and_compile():
    logits, target = _inputs(4, 37, torch.float32)
    x = logits.clone().requires_grad_()
    ops = torch.ops.megagspo
    torch.library.opcheck(ops.logprob_forward.default, (x, target, True, False))
    torch.library.opcheck(ops.logprob_stats.default, (logits, target, 5, True))
    lp, ent, lse = ops.logprob_forward(logits, target, True, False)
    torch.library.opcheck(ops.logprob_backward.default, (torch.ones(4), torch.ones(4), logits, target, lse, ent, 0))

    def f(x, target):
        lp, ent = K.token_logprobs(x, target, with_entropy=True, impl="fused")
        return (lp + 0.1 * ent).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = x.detach().clone().requires_grad_()
    compiled(y, target).backward()
    f(x, target).backward()
    assert torch.allclose(y.grad, x.grad)


def test_reference_fallback_warns_once(monkeypatch):
    logits, target = _inputs(3, 11, torch.float32)
    monkeypatch.setattr(K, "has_device_kernel", lambda device: False)
    monkeypatch.setattr(K, "extension_error", lambda: "megagspo._C could not be imported (test)")
    K._warn_fallback_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = K.token_logprobs(logits, target)
        b = K.token_logprobs(logits, target)
    K._warn_fallback_once.cache_clear()
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "falling back to the pure-torch reference" in msgs[0] and "(test)" in msgs[0]
    assert torch.allclose(a, R.token_logprobs_ref(logits, target)) and torch.equal(a, b)
    with pytest.raises(RuntimeError, match="impl='fused' requested"):
        K.token_logprobs(logits, target, impl="fused")


# ---- vocab parallel over 2 gloo ranks ----------------------------------------------------------------------
def _vocab_parallel_body(rank, world_size, seed, T, V, split, dtype, inplace, impl):
    torch.manual_seed(seed)  # same full logits on every rank
    logits = (torch.randn(T, V, dtype=torch.float64) * 3).to(dtype)
    logits[0, 0] = -float("inf") if V > 7 else logits[0, 0]
    target = torch.randint(0, V, (T,))
    g_lp, g_h = torch.randn(T), torch.randn(T)
    bounds = [0, split, V]
    lo, hi = bounds[rank], bounds[rank + 1]
    acc = R.acc_dtype(dtype)

    h = logits[:, lo:hi].clone().requires_grad_()
    shard = h * 1.0 if inplace else h
    lp, ent = K.token_logprobs(shard, target, with_entropy=True, inplace_backward=inplace,
                               tp_group=torch.distributed.group.WORLD, vocab_start=lo, impl=impl)
    (lp * g_lp.to(acc) + ent * g_h.to(acc)).sum().backward()

    full = logits.clone().requires_grad_()
    lp1, ent1 = K.token_logprobs(full, target, with_entropy=True, impl=impl)  # TP = 1
    (lp1 * g_lp.to(acc) + ent1 * g_h.to(acc)).sum().backward()
    return lp, ent, h.grad, lp1, ent1, full.grad[:, lo:hi]


# (T, V, split, dtype, inplace, impl); one spawn of 2 ranks runs them all (process start-up dominates).
VOCAB_PARALLEL_CASES = [
    (5, 7, 4, torch.float32, False, "fused"),  # uneven shards of a tiny vocab
    (3, 151_936, 75_968, torch.bfloat16, True, "fused"),  # Qwen3 vocab, Megatron's even split, in place
    (4, 4099, 2000, torch.float64, False, "fused"),
    (1, 4099, 1, torch.float32, False, "fused"),  # T = 1, a one-column shard
    (4, 515, 300, torch.float32, False, "reference"),
]


def _vocab_parallel_cases_body(rank, world_size, seed):
    return [_vocab_parallel_body(rank, world_size, seed + i, *case) for i, case in enumerate(VOCAB_PARALLEL_CASES)]


@pytest.mark.multiprocess
def test_vocab_parallel_matches_tp1():
    seed = reseed_torch()
    per_rank = run_distributed(_vocab_parallel_cases_body, world_size=2, args=(seed,), timeout_s=240)
    for i, (T, V, split, dtype, inplace, impl) in enumerate(VOCAB_PARALLEL_CASES):
        case = f"T={T} V={V} split={split} {dtype} inplace={inplace} impl={impl} (seed {seed + i})"
        tol = 1e-12 if dtype == torch.float64 else 3e-6
        gtol = 1e-12 if dtype == torch.float64 else (2e-6 if dtype == torch.float32 else 1e-2)
        for rank in range(2):
            lp, ent, grad, lp1, ent1, grad1 = per_rank[rank][i]
            assert (lp <= 0).all(), case
            assert torch.allclose(lp, lp1, atol=tol, rtol=tol), f"rank {rank} logp: {case}"
            assert torch.allclose(ent, ent1, atol=tol * 4, rtol=tol), f"rank {rank} entropy: {case}"
            assert torch.allclose(grad.double(), grad1.double(), atol=gtol, rtol=gtol), f"rank {rank} grad: {case}"
        assert torch.equal(per_rank[0][i][0], per_rank[1][i][0]), f"ranks disagree on logp: {case}"


# ---- CUDA (skipped without a GPU) ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("T,V", [(1, 7), (7, 4099), (3, 151_936)], ids=lambda v: str(v))
def test_cuda_matches_cpu(T, V, dtype):
    if not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")
    seed = reseed_torch()
    logits, target = _inputs(T, V, dtype)
    g_lp, g_h = torch.randn(T), torch.randn(T)
    out = []
    for device in ("cpu", "cuda"):
        # A fresh leaf per device. (`logits.to("cpu")` IS `logits`: calling requires_grad_() on it made the CUDA
        # copy of the next iteration a non-leaf, whose .grad stays None.)
        x = logits.detach().to(device, copy=True).requires_grad_()
        assert x.is_leaf and x.device.type == device
        lp, ent = K.token_logprobs(x, target.to(device), with_entropy=True, impl="fused")
        assert lp.device.type == device and ent.device.type == device
        (lp * g_lp.to(device, lp.dtype) + ent * g_h.to(device, lp.dtype)).sum().backward()
        assert x.grad is not None and x.grad.dtype == dtype and x.grad.device.type == device, device
        out.append((lp.detach().cpu(), ent.detach().cpu(), x.grad.cpu()))
    ref = _fp64_reference(logits, target, g_lp, g_h)
    same_grad = _torch_same_precision(logits, target, g_lp, g_h)[2] if dtype != torch.float64 else None
    for i, name in enumerate(["logp", "entropy", "d logits"]):
        same = same_grad if i == 2 else None
        assert_close_rel(out[0][i], ref[i], same, dtype, f"cpu {name}", seed)
        assert_close_rel(out[1][i], ref[i], same, dtype, f"cuda {name}", seed)
        assert_devices_agree(out[1][i], out[0][i], ref[i], same, dtype, name, seed)
    assert (out[1][0] <= 0).all()


def assert_devices_agree(cuda, cpu, ref, same_prec, dtype, what, seed):
    """CUDA against CPU directly: each is within `bound` of the float64 reference (assert_close_rel), so they may
    differ by at most 2 x bound; checked element by element."""
    atol, rtol = TOL[dtype]
    torch_err = (same_prec - ref).abs().max().item() if same_prec is not None else 0.0
    bound = 2 * (2 * torch_err + atol + rtol * ref.abs())
    err = (cuda.to(torch.float64) - cpu.to(torch.float64)).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"cuda vs cpu {what} ({dtype}): max difference {err.max().item():.3e} (seed {seed})"


@pytest.mark.gpu
def test_cuda_refuses_mixed_devices_before_any_kernel():
    """A CUDA build must refuse arguments on two devices with an error naming the argument, before any kernel runs
    (a kernel would otherwise read a host pointer as a device one), and keep working afterwards."""
    if not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")
    ops = torch.ops.megagspo
    logits, target = _inputs(3, 11, torch.float32)
    lc, tc = logits.cuda(), target.cuda()
    with pytest.raises(RuntimeError, match=r"target is on cpu but logits is on cuda"):
        ops.logprob_forward(lc, target, False, False)
    with pytest.raises(RuntimeError, match=r"target is on cuda:0 but logits is on cpu"):
        ops.logprob_forward(logits, tc, False, False)
    with pytest.raises(RuntimeError, match=r"target is on cpu but logits is on cuda"):
        ops.logprob_stats(lc, target, 0, True)
    lp, ent, lse = ops.logprob_forward(lc, tc, True, False)
    g = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match=r"grad_logp is on cpu but logits is on cuda"):
        ops.logprob_backward(g.cpu(), None, lc, tc, lse, None, 0)
    with pytest.raises(RuntimeError, match=r"lse is on cpu but logits is on cuda"):
        ops.logprob_backward(g, None, lc, tc, lse.cpu(), None, 0)
    with pytest.raises(RuntimeError, match=r"entropy is on cpu but logits is on cuda"):
        ops.logprob_backward(g, g, lc, tc, lse, ent.cpu(), 0)
    x = lc.clone()
    with pytest.raises(RuntimeError, match=r"grad_entropy is on cpu but logits is on cuda"):
        ops.logprob_backward_(x, g, g.cpu(), tc, lse, ent, 0)
    assert torch.equal(x, lc), "a refused in-place backward must leave the logits untouched"
    with pytest.raises(RuntimeError, match="vocab_start must be >= 0"):
        ops.logprob_stats(lc, tc, -1, False)
    with pytest.raises(RuntimeError, match="contiguous along vocab"):
        ops.logprob_forward(lc.t().contiguous().t(), tc, False, False)
    with pytest.raises(RuntimeError, match=r"float32, float64, bfloat16 or float16.*Int"):
        ops.logprob_forward(lc.int(), tc, False, False)
    with pytest.raises(ValueError, match=r"token_logprobs: target is on cpu but logits is on cuda"):
        K.token_logprobs(lc, target, impl="fused")
    with pytest.raises(ValueError, match=r"linear_token_logprobs: weight is on cpu but hidden is on cuda"):
        K.linear_token_logprobs(torch.randn(3, 4, device="cuda"), torch.randn(11, 4), tc)
    torch.cuda.synchronize()  # no kernel ran on a bad argument, so none faulted
    again = ops.logprob_forward(lc, tc, False, False)[0].cpu()
    assert_close_rel(again, R.token_logprobs_ref(logits.double(), target), None, torch.float32, "logp", 0)


@pytest.mark.gpu
def test_cuda_out_of_vocab_target_is_nan_not_a_fault():
    """Target VALUES are not checked on CUDA (that would be a host sync per call, csrc/checks.h): an id outside
    the vocabulary gives a NaN log-prob for that token only, and no out-of-bounds access."""
    if not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")
    logits, _ = _inputs(3, 11, torch.float32)
    lp = K.token_logprobs(logits.cuda(), torch.tensor([0, 11, -1], device="cuda"), impl="fused")
    torch.cuda.synchronize()
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_memory_forward_o_t_backward_only_the_gradient(dtype):
    """Allocations inside the ops (torch.profiler): forward 12 B per token (logp, entropy, lse in float32),
    backward exactly d logits in the logits' dtype, in-place backward nothing of size T x V."""
    from torch.profiler import ProfilerActivity, profile

    T, V = 64, 20_000
    logits, target = _inputs(T, V, dtype)

    def op_bytes(fn):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return {e.name: e.cpu_memory_usage for e in prof.events() if e.name.startswith("megagspo::")}

    def run(inplace):
        h = logits.clone().requires_grad_()
        x = h * 1.0
        lp, ent = K.token_logprobs(x, target, with_entropy=True, inplace_backward=inplace, impl="fused")
        (lp.sum() + ent.sum()).backward()

    out = op_bytes(lambda: run(False))
    assert out["megagspo::logprob_forward"] == 3 * 4 * T
    assert out["megagspo::logprob_backward"] == T * V * logits.element_size()
    out = op_bytes(lambda: run(True))
    assert out["megagspo::logprob_forward"] == 3 * 4 * T
    assert out["megagspo::logprob_backward_"] <= 64 * T
