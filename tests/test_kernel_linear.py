"""Chunked linear log-probs (logits recomputed per token chunk) against the naive full-logits reference.

Legend: T tokens, H hidden, V vocab. Fresh random inputs every run; seeds appear in failure messages.

The first three tests run on the CPU and, marked gpu, on CUDA (`device` = "cuda", tests/devices.py; inputs
drawn on the CPU then moved, so a seed gives the same inputs on both): the fused path there is the CUDA
log-prob kernel over cuBLAS chunk GEMMs (TF32 off, torch's default), the reference the same torch ops on the
GPU. Tolerances on CUDA are stated beside each comparison.
"""

from __future__ import annotations

import pytest
import torch

import megagspo.kernels as K
from devices import DEVICES

# dtype -> (atol, rtol) of logp / entropy / d hidden / d weight against the float64 reference.
TOL = {
    torch.float64: (1e-11, 1e-10),
    torch.float32: (2e-5, 1e-4),  # the GEMMs dominate: same as a float32 torch run
}
# bf16 logits are rounded to 8 mantissa bits by the GEMM itself, so the error against float64 is set by the
# inputs (it reached 0.094 on a 3.6 gradient entry), not by the kernel. What the kernel owes is to be as
# accurate as the naive bf16 path: ||fused - f64|| <= LOWP_RATIO ||naive - f64|| + LOWP_FLOOR ||f64||.
# Measured over 1000 seeds per shape the ratio is <= 1.00 for logp / entropy / d hidden and <= 1.20 for
# d weight, whose per-chunk products are rounded to bf16 before their float32 sum.
LOWP_RATIO, LOWP_FLOOR = 1.5, 1e-3
LOWP_MAX_REL = 0.1  # and never worse than 10% relative (norm) error, whatever the naive path does

pytestmark = pytest.mark.skipif(not K.fused_available("cpu"), reason="megagspo._C not built (make ext)")


def _need(device):
    if device == "cuda" and not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")


def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    return seed


def _run(fn, hidden, weight, target, g_lp, g_h, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fn(h, w, target, with_entropy=True, **kw)
    (lp * g_lp.to(lp.dtype) + ent * g_h.to(lp.dtype)).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,H,V,chunk", [(1, 8, 7, 4), (13, 16, 1001, 4), (9, 32, 4099, 1), (6, 8, 300, 100)])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_naive(T, H, V, chunk, dtype, device):
    # CUDA: the same TOL / LOWP bounds (against float64, not against the CPU): the CUDA kernel's
    # --use_fast_math exp/log cost ~2 ulp of float32 (~2.4e-7 relative), well inside float32's 1e-4 rtol, and
    # do not touch float64; cuBLAS float32 GEMMs without TF32 are as accurate as the CPU's.
    _need(device)
    seed = _seed()
    hidden = torch.randn(T, H, dtype=torch.float64).to(dtype).to(device)
    weight = (torch.randn(V, H, dtype=torch.float64) / H**0.5 * 3).to(dtype).to(device)
    target = torch.randint(0, V, (T,)).to(device)
    g_lp, g_h = torch.randn(T).to(device), torch.randn(T).to(device)
    fused = _run(K.linear_token_logprobs, hidden, weight, target, g_lp, g_h, chunk_size=chunk, impl="fused")
    ref = _run(K.linear_token_logprobs, hidden.double(), weight.double(), target, g_lp, g_h, impl="reference")
    names = ["logp", "entropy", "d hidden", "d weight"]
    if dtype in TOL:
        atol, rtol = TOL[dtype]
        for name, a, b in zip(names, fused, ref):
            assert a.shape == b.shape
            assert torch.allclose(a.double(), b, atol=atol, rtol=rtol), (
                f"{name} ({dtype}, T={T} V={V} chunk={chunk}): max diff {(a.double() - b).abs().max().item():.3e} "
                f"(seed {seed})")
    else:
        naive = _run(K.linear_token_logprobs, hidden, weight, target, g_lp, g_h, impl="reference")
        for name, a, n, b in zip(names, fused, naive, ref):
            assert a.shape == b.shape and a.dtype == n.dtype
            err_fused, err_naive = (a.double() - b).norm().item(), (n.double() - b).norm().item()
            scale = b.norm().item()
            assert err_fused <= LOWP_RATIO * err_naive + LOWP_FLOOR * scale, (
                f"{name} ({dtype}, T={T} V={V} chunk={chunk}): fused error {err_fused:.3e} vs naive {dtype} error "
                f"{err_naive:.3e} (norm of the float64 result {scale:.3e}; seed {seed})")
            assert err_fused <= LOWP_MAX_REL * scale, (
                f"{name} ({dtype}): relative error {err_fused / scale:.3e} > {LOWP_MAX_REL} (seed {seed})")
    assert all(t.device.type == device for t in fused)
    assert (fused[0] <= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_size_invariance_and_fallback_path(device):
    _need(device)
    seed = _seed()
    T, H, V = 11, 16, 513
    hidden, weight = torch.randn(T, H).to(device), (torch.randn(V, H) / 4).to(device)
    target = torch.randint(0, V, (T,)).to(device)
    g_lp, g_h = torch.randn(T).to(device), torch.randn(T).to(device)
    runs = [_run(K.linear_token_logprobs, hidden, weight, target, g_lp, g_h, chunk_size=c, impl="fused")
            for c in (1, 4, 11, 64)]
    # CUDA: atol 1e-5 (CPU 1e-6): cuBLAS picks its float32 GEMM algorithm (split-K included) by shape, so
    # chunks of 1, 4, 11 and 64 rows sum H and the chunks' d weight contributions in different orders.
    atol = 1e-5 if device == "cuda" else 1e-6
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.allclose(a, b, atol=atol, rtol=1e-5), f"chunking changed the result (seed {seed})"
    # the extension-less fallback runs the same chunking over the reference ops
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = K._LinearLogProb.apply(h, w, target, 4, True, K._REFERENCE_BACKEND)
    (lp * g_lp + ent * g_h).sum().backward()
    for a, b in zip((lp.detach(), ent.detach(), h.grad, w.grad), runs[0]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), f"reference-backend chunking differs (seed {seed})"


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    # CUDA: the same eps / atol (float64 kernels: --use_fast_math changes float32 intrinsics only)
    _need(device)
    _seed()
    T, H, V = 5, 4, 9
    hidden = torch.randn(T, H, dtype=torch.float64).to(device).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64).to(device).requires_grad_()
    target = torch.randint(0, V, (T,)).to(device)

    def fn(h, w):
        return K.linear_token_logprobs(h, w, target, chunk_size=2, with_entropy=True, impl="fused")

    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-6, atol=1e-8)


def test_input_checks():
    with pytest.raises(ValueError, match=r"hidden \[T, H\] and weight \[V, H\].*\(3, 4\) and \(5, 6\)"):
        K.linear_token_logprobs(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        K.linear_token_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), chunk_size=0)
