"""Segmented GSPO kernel (megagspo._C) against its pure-torch reference and the algorithm core.

Legend (docs/architecture.md): T tokens, N sequences (spelled `_S` in names; `_S1`: N + 1 offsets). Fresh random inputs every run; seeds appear in failure messages.
"""

from __future__ import annotations

import pytest
import torch

import megagspo.kernels as K
from helpers import reseed_torch

# dtype of logp -> (atol, rtol) for loss / per-sequence outputs / d logp against the reference in that dtype.
TOL = {
    torch.float64: (1e-13, 1e-11),
    torch.float32: (1e-6, 1e-5),
    torch.bfloat16: (1e-6, 1e-5),  # inputs bf16, accumulation float32 in both: only summation order differs
}

pytestmark = pytest.mark.skipif(not K.fused_available("cpu"), reason="megagspo._C not built (make ext)")


def _batch(lengths, dtype, *, lead=0, trail=0, masked_seqs=(), spread=3e-4, cu_dtype=torch.int64, float_mask=False):
    """Packed batch: `lead` / `trail` tokens outside every sequence; sequences in `masked_seqs` fully masked."""
    T = lead + sum(lengths) + trail
    cu = torch.tensor([lead] + lengths, dtype=torch.int64).cumsum(0).to(cu_dtype)
    old = -torch.rand(T, dtype=torch.float64) * 5
    # per-sequence shifts around 0 so that s_i = exp(m_i) lands on both sides of both clip bounds
    shift_S = (torch.rand(len(lengths), dtype=torch.float64) * 2 - 1) * 3 * spread
    shift_T = torch.zeros(T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        shift_T[int(cu[i]):int(cu[i]) + n] = shift_S[i]
    logp = old + shift_T + torch.randn(T, dtype=torch.float64) * spread
    mask = torch.rand(T) < 0.8
    for i in masked_seqs:
        mask[int(cu[i]):int(cu[i + 1])] = False
    adv = torch.randn(len(lengths), dtype=torch.float64)
    adv[::5] = 0.0
    mask = mask.to(dtype) if float_mask else mask
    return logp.to(dtype), old.to(dtype), mask, cu, adv


def _run(impl, logp, old, mask, cu, adv, n, **kw):
    x = logp.clone().requires_grad_()
    loss, metrics = K.gspo_segment_loss(x, old, mask, cu, adv, num_global_sequences=n, impl=impl, **kw)
    loss.backward()
    return loss.detach(), metrics, x.grad


def _close(a, b, dtype, what, seed):
    atol, rtol = TOL[dtype]
    assert torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol), (
        f"{what} ({dtype}): max diff {(a.double() - b.double()).abs().max().item():.3e} (seed {seed})")


CASES = {
    "mixed": dict(lengths=[5, 1, 17, 3, 64, 1, 9], masked_seqs=(3,)),
    "single_token": dict(lengths=[1]),
    "all_length_one": dict(lengths=[1] * 11, masked_seqs=(0, 4)),
    "outside_tokens": dict(lengths=[4, 6, 2], lead=3, trail=5),
    "empty_sequences": dict(lengths=[3, 0, 5, 0]),
    "fully_masked_batch": dict(lengths=[4, 2], masked_seqs=(0, 1)),
    "many": dict(lengths=[int(n) for n in torch.randint(1, 300, (200,))], masked_seqs=(7, 99)),
    "int32_cu_float_mask": dict(lengths=[7, 2, 30], cu_dtype=torch.int32, float_mask=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    seed = reseed_torch()
    logp, old, mask, cu, adv = _batch(dtype=dtype, **CASES[case])
    n = cu.numel() + 2
    lf, mf, gf = _run("fused", logp, old, mask, cu, adv, n)
    lr, mr, gr = _run("reference", logp, old, mask, cu, adv, n)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert lf.dtype == acc and lf.shape == () and gf.dtype == dtype and gf.shape == logp.shape
    _close(lf, lr, dtype, "loss", seed)
    _close(mf["seq_logratio_S"], mr["seq_logratio_S"], dtype, "seq_logratio", seed)
    _close(mf["ratio_S"], mr["ratio_S"], dtype, "ratio", seed)
    assert torch.equal(mf["clipped_S"], mr["clipped_S"]), f"clip flags (seed {seed})"
    _close(gf, gr, dtype, "d logp", seed)
    # fully masked sequences and tokens outside every sequence: zero loss contribution, zero gradient
    w = mask.bool()
    assert (gf[~w] == 0).all()
    for i in CASES[case].get("masked_seqs", ()):
        assert not mf["clipped_S"][i]


def test_clipping_both_sides_and_gradient_formula():
    """Hand-built ratios: eq. 6 clip flags and eq. 11 d loss / d logp = -(1/N) A s mask / |y| [not clipped]."""
    lo, hi = 3e-4, 4e-4
    m_S = torch.tensor([1e-3, 1e-3, -1e-3, -1e-3, 1e-4, 0.0], dtype=torch.float64)  # log s_i
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, 1.5], dtype=torch.float64)
    lengths = [3, 2, 4, 1, 2, 3]
    cu = torch.tensor([0] + lengths).cumsum(0)
    old = -torch.rand(sum(lengths), dtype=torch.float64)
    logp = old + torch.repeat_interleave(m_S, torch.tensor(lengths))
    mask = torch.ones(sum(lengths), dtype=torch.bool)
    mask[-1] = False  # last sequence: |y| = 2 of 3 tokens
    N = 10
    loss, metrics, grad = _run("fused", logp, old, mask, cu, adv, N, clip_low=lo, clip_high=hi)
    expected_clip = torch.tensor([True, False, False, True, False, False])
    assert torch.equal(metrics["clipped_S"], expected_clip)
    s = metrics["ratio_S"]
    assert torch.allclose(s, torch.exp(m_S), rtol=1e-12)
    obj = torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)
    assert torch.allclose(loss, -obj.sum() / N, rtol=1e-12)
    ylen = torch.tensor([3, 2, 4, 1, 2, 2], dtype=torch.float64)
    coef_S = -(adv * s / ylen / N) * (~expected_clip)
    expected = torch.repeat_interleave(coef_S, torch.tensor(lengths)) * mask
    assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-15)


def test_gradcheck_float64():
    reseed_torch()
    logp, old, mask, cu, adv = _batch([4, 1, 6, 2], torch.float64, masked_seqs=(1,), lead=1, trail=2, spread=1e-4)

    def fn(x):
        return K.gspo_segment_loss(x, old, mask, cu, adv, num_global_sequences=4, impl="fused")[0]

    assert torch.autograd.gradcheck(fn, (logp.clone().requires_grad_(),), eps=1e-7, atol=1e-9)


def test_num_global_sequences_tensor_and_checks():
    seed = reseed_torch()
    logp, old, mask, cu, adv = _batch([3, 5], torch.float32)
    a = _run("fused", logp, old, mask, cu, adv, 6)
    b = _run("fused", logp, old, mask, cu, adv, torch.tensor(6.0))
    _close(a[0], b[0], torch.float32, "loss", seed)
    _close(a[2], b[2], torch.float32, "d logp", seed)
    with pytest.raises(RuntimeError, match=r"advantages must be 1-D \[2\].*\[3\]"):
        torch.ops.megagspo.gspo_segment_forward(logp, old, mask, cu, torch.zeros(3), 3e-4, 4e-4, 2.0)
    with pytest.raises(RuntimeError, match=r"cu_seqlens must be non-decreasing"):
        K.gspo_segment_loss(logp, old, mask, torch.tensor([0, 5, 3]), adv, num_global_sequences=2, impl="fused")
    with pytest.raises(RuntimeError, match=r"old_logp must match logp"):
        torch.ops.megagspo.gspo_segment_forward(logp, old[:-1], mask, cu, adv.float(), 3e-4, 4e-4, 2.0)
    with pytest.raises(ValueError, match="num_global_sequences must be > 0"):
        K.gspo_segment_loss(logp, old, mask, cu, adv, num_global_sequences=0)


def test_every_op_argument_is_checked_before_it_runs():
    """Both GSPO ops refuse each bad argument with a RuntimeError naming it (csrc/checks.h), before any kernel."""
    ops = torch.ops.megagspo
    logp, old, mask, cu, adv = _batch([3, 5], torch.float32)
    adv = adv.float()

    def fwd(logp=logp, old=old, mask=mask, cu=cu, adv=adv, clip_low=3e-4, clip_high=4e-4, n=2.0):
        return ops.gspo_segment_forward(logp, old, mask, cu, adv, clip_low, clip_high, n)

    cases = [
        (dict(cu=cu.float()), r"cu_seqlens must be int32 or int64.*Float"),
        (dict(cu=cu[None]), r"cu_seqlens must be 1-D \[sequences \+ 1\]"),
        (dict(cu=torch.stack([cu, cu], 1)[:, 0]), r"cu_seqlens must be contiguous"),
        (dict(mask=mask[:-1]), r"loss_mask must be 1-D \[8\]"),
        (dict(mask=mask.int()), r"loss_mask must be bool or the dtype of logp"),
        (dict(logp=torch.stack([logp, logp], 1)[:, 0]), r"logp must be contiguous"),
        (dict(logp=logp.int(), old=old.int()), r"logp must be a floating dtype"),
        (dict(adv=adv.double()), r"advantages must be Float for logp of dtype Float.*Double"),
        (dict(clip_low=1.0), r"clip_low must be in \[0, 1\); got 1"),
        (dict(clip_high=-0.1), r"clip_high must be >= 0; got -0.1"),
        (dict(n=0.0), r"num_global_sequences must be > 0 and finite; got 0"),
        (dict(n=float("nan")), r"num_global_sequences must be > 0 and finite; got nan"),
        (dict(n=float("inf")), r"num_global_sequences must be > 0 and finite; got inf"),
    ]
    for kw, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fwd(**kw)
    _loss, _m, _s, _clipped, coef = fwd()
    g = torch.ones(())

    def bwd(g=g, coef=coef, mask=mask, cu=cu, out_dtype=torch.float32):
        return ops.gspo_segment_backward(g, coef, mask, cu, out_dtype)

    cases = [
        (dict(g=torch.ones(2)), r"grad_loss must hold one value"),
        (dict(g=torch.ones((), dtype=torch.int64)), r"grad_loss must be a floating dtype"),
        (dict(coef=coef.double()), r"coef must be Float for out_dtype Float"),
        (dict(coef=coef[:1]), r"coef must be 1-D \[sequences\] matching cu_seqlens \[3\]"),
        (dict(cu=cu.float()), r"cu_seqlens must be int32 or int64"),
        (dict(cu=torch.tensor([0, 5, 3])), r"cu_seqlens must be non-decreasing.*cu_seqlens\[2\] = 3"),
        (dict(mask=mask.int()), r"loss_mask must be bool or a floating dtype"),
        (dict(out_dtype=torch.int32), r"out_dtype must be float32, float64, bfloat16 or float16"),
    ]
    for kw, match in cases:
        with pytest.raises(RuntimeError, match=match):
            bwd(**kw)
    assert torch.equal(bwd(), _run("fused", logp, old, mask, cu, adv, 2.0)[2])


def test_num_global_sequences_forms():
    """A number, a CPU tensor (read on the host, which costs nothing) or a one-element tensor on logp's device;
    anything else is a ValueError naming num_global_sequences, raised before any kernel runs."""
    seed = reseed_torch()
    logp, old, mask, cu, adv = _batch([3, 5], torch.float32)
    a = _run("fused", logp, old, mask, cu, adv, 6)
    for n in (torch.tensor([6.0]), torch.tensor(6, dtype=torch.int64), torch.tensor([[6.0]], dtype=torch.float64)):
        b = _run("fused", logp, old, mask, cu, adv, n)
        assert b[0].shape == (), f"a {tuple(n.shape)} count must keep the loss 0-dim"
        _close(a[0], b[0], torch.float32, f"loss, count {n!r}", seed)
        _close(a[2], b[2], torch.float32, f"d logp, count {n!r}", seed)
    bad = [
        (torch.tensor([6.0, 6.0]), "one-element real tensor"),
        (torch.tensor(True), "one-element real tensor"),
        (torch.tensor(0.0), "> 0 and finite; got 0.0"),
        (torch.tensor(float("nan")), "> 0 and finite; got nan"),
        (float("nan"), "> 0 and finite"),
        (float("inf"), "> 0 and finite"),
        (-3, "> 0 and finite"),
        (True, "must be a count"),
        ("six", "must be a number or a one-element tensor"),
        (torch.tensor(6.0, device="meta"), "num_global_sequences is on meta but logp is on cpu"),
    ]
    for impl in ("fused", "reference"):
        for n, match in bad:
            with pytest.raises(ValueError, match=match):
                K.gspo_segment_loss(logp, old, mask, cu, adv, num_global_sequences=n, impl=impl)


def test_wrapper_refuses_arguments_on_another_device():
    """Every tensor argument must be on logp's device: a ValueError naming it, before a backend is chosen (the
    meta device stands in for a second device on a host without one)."""
    logp, old, mask, cu, adv = _batch([3, 5], torch.float32)
    args = dict(old_logp=old, loss_mask=mask, cu_seqlens=cu, advantages=adv)
    for name in args:
        moved = [t.to("meta") if k == name else t for k, t in args.items()]
        for impl in ("fused", "reference"):
            with pytest.raises(ValueError, match=f"gspo_segment_loss: {name} is on meta but logp is on cpu"):
                K.gspo_segment_loss(logp, *moved, num_global_sequences=2, impl=impl)


def test_opcheck_and_compile():
    logp, old, mask, cu, adv = _batch([3, 1, 4], torch.float32)
    x = logp.clone().requires_grad_()
    torch.library.opcheck(torch.ops.megagspo.gspo_segment_forward.default,
                          (x, old, mask, cu, adv.float(), 3e-4, 4e-4, 5.0))

    def f(x):
        return K.gspo_segment_loss(x, old, mask, cu, adv, num_global_sequences=5, impl="fused")[0]

    y = x.detach().clone().requires_grad_()
    torch.compile(f, backend="aot_eager", fullgraph=True)(y).backward()
    f(x).backward()
    assert torch.allclose(x.grad, y.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_matches_algorithm_core(dtype):
    """The fused kernel must agree with megagspo.algorithm.gspo_sequence_loss (the algorithm core's GSPO)."""
    from megagspo.algorithm import gspo_sequence_loss  # not skipped: a missing core is a failure

    seed = reseed_torch()
    for case in ("mixed", "many", "all_length_one"):
        logp, old, mask, cu, adv = _batch(dtype=dtype, **CASES[case])
        n = cu.numel() + 3
        lf, mf, gf = _run("fused", logp, old, mask, cu, adv, n)
        x = logp.clone().requires_grad_()
        lc, mc = gspo_sequence_loss(x, old, mask, cu, adv.to(dtype), clip_low=3e-4, clip_high=4e-4,
                                    num_global_sequences=n)
        lc.backward()
        _close(lf, lc.detach(), dtype, f"loss vs algorithm core [{case}]", seed)
        _close(gf, x.grad, dtype, f"d logp vs algorithm core [{case}]", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixed", "many", "outside_tokens", "empty_sequences"])
def test_cuda_matches_cpu(case):
    if not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")
    seed = reseed_torch()
    logp, old, mask, cu, adv = _batch(dtype=torch.float32, **CASES[case])
    lc, mc, gc = _run("fused", logp, old, mask, cu, adv, 7)
    lg, mg, gg = _run("fused", logp.cuda(), old.cuda(), mask.cuda(), cu.cuda(), adv.cuda(), 7)
    _close(lg.cpu(), lc, torch.float32, "cuda loss", seed)
    _close(gg.cpu(), gc, torch.float32, "cuda d logp", seed)
    assert torch.equal(mg["clipped_S"].cpu(), mc["clipped_S"])


@pytest.mark.gpu
def test_cuda_refuses_mixed_devices_and_a_foreign_count():
    """A CUDA build refuses tensors on two devices (RuntimeError from the op, ValueError from the wrapper, each
    naming the argument) before any kernel runs; num_global_sequences may be a tensor on logp's device or on the
    CPU, never on another device."""
    if not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")
    seed = reseed_torch()
    ops = torch.ops.megagspo
    logp, old, mask, cu, adv = _batch([3, 5, 2], torch.float32)
    adv = adv.float()
    dev = [t.cuda() for t in (logp, old, mask, cu, adv)]
    for i, name in enumerate(["old_logp", "loss_mask", "cu_seqlens", "advantages"], start=1):
        args = list(dev)
        args[i] = args[i].cpu()
        with pytest.raises(RuntimeError, match=f"{name} is on cpu but logp is on cuda"):
            ops.gspo_segment_forward(*args, 3e-4, 4e-4, 2.0)
        with pytest.raises(ValueError, match=f"gspo_segment_loss: {name} is on cpu but logp is on cuda"):
            K.gspo_segment_loss(*args, num_global_sequences=2, impl="fused")
    with pytest.raises(RuntimeError, match="old_logp is on cuda:0 but logp is on cpu"):  # the CUDA kernel refuses
        ops.gspo_segment_forward(logp, *dev[1:], 3e-4, 4e-4, 2.0)

    a = _run("fused", *dev, 6)
    for n in (torch.tensor(6.0, device="cuda"), torch.tensor([6.0]), torch.tensor(6)):
        b = _run("fused", *dev, n)
        assert b[0].device.type == "cuda" and b[0].shape == ()
        _close(b[0].cpu(), a[0].cpu(), torch.float32, f"loss, count {n!r}", seed)
        _close(b[2].cpu(), a[2].cpu(), torch.float32, f"d logp, count {n!r}", seed)
    with pytest.raises(ValueError, match="num_global_sequences is on cuda:0 but logp is on cpu"):
        K.gspo_segment_loss(logp, old, mask, cu, adv, num_global_sequences=torch.tensor(6.0, device="cuda"),
                            impl="fused")

    _loss, _m, _s, _clipped, coef = ops.gspo_segment_forward(*dev, 3e-4, 4e-4, 2.0)
    g = torch.ones((), device="cuda")
    with pytest.raises(RuntimeError, match="grad_loss is on cpu but coef is on cuda"):
        ops.gspo_segment_backward(g.cpu(), coef, dev[2], dev[3], torch.float32)
    with pytest.raises(RuntimeError, match="loss_mask is on cpu but coef is on cuda"):
        ops.gspo_segment_backward(g, coef, mask, dev[3], torch.float32)
    with pytest.raises(RuntimeError, match="cu_seqlens is on cpu but coef is on cuda"):
        ops.gspo_segment_backward(g, coef, dev[2], cu, torch.float32)
    with pytest.raises(RuntimeError, match="grad_loss is on cuda:0 but coef is on cpu"):  # CPU coef, the rest CUDA
        ops.gspo_segment_backward(g, coef.cpu(), dev[2], dev[3], torch.float32)
    torch.cuda.synchronize()  # no kernel ran on a bad argument, so none faulted
    grad = ops.gspo_segment_backward(g, coef, dev[2], dev[3], torch.float32)
    _close(grad.cpu(), ops.gspo_segment_backward(g.cpu(), coef.cpu(), mask, cu, torch.float32), torch.float32,
           "cuda gspo backward", seed)
