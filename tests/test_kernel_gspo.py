"""Segmented GSPO kernel (megagspo._C) against its pure-torch reference and the algorithm core.

Legend: T tokens, S sequences, S1 = S + 1. Fresh random inputs every run; seeds appear in failure messages.
"""

from __future__ import annotations

import pytest
import torch

import megagspo.kernels as K

# dtype of logp -> (atol, rtol) for loss / per-sequence outputs / d logp against the reference in that dtype.
TOL = {
    torch.float64: (1e-13, 1e-11),
    torch.float32: (1e-6, 1e-5),
    torch.bfloat16: (1e-6, 1e-5),  # inputs bf16, accumulation float32 in both: only summation order differs
}

pytestmark = pytest.mark.skipif(not K.fused_available("cpu"), reason="megagspo._C not built (make ext)")


def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    return seed


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
    seed = _seed()
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
    _seed()
    logp, old, mask, cu, adv = _batch([4, 1, 6, 2], torch.float64, masked_seqs=(1,), lead=1, trail=2, spread=1e-4)

    def fn(x):
        return K.gspo_segment_loss(x, old, mask, cu, adv, num_global_sequences=4, impl="fused")[0]

    assert torch.autograd.gradcheck(fn, (logp.clone().requires_grad_(),), eps=1e-7, atol=1e-9)


def test_num_global_sequences_tensor_and_checks():
    seed = _seed()
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

    seed = _seed()
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
    seed = _seed()
    logp, old, mask, cu, adv = _batch(dtype=torch.float32, **CASES[case])
    lc, mc, gc = _run("fused", logp, old, mask, cu, adv, 7)
    lg, mg, gg = _run("fused", logp.cuda(), old.cuda(), mask.cuda(), cu.cuda(), adv.cuda(), 7)
    _close(lg.cpu(), lc, torch.float32, "cuda loss", seed)
    _close(gg.cpu(), gc, torch.float32, "cuda d logp", seed)
    assert torch.equal(mg["clipped_S"].cpu(), mc["clipped_S"])
