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
from helpers import reseed_torch

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
    seed = reseed_torch()
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
    seed = reseed_torch()
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
    reseed_torch()
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


# ------------------------------------------------------------------ d weight into Megatron DDP's main_grad
def _megatron_hook(param, ready):
    """Megatron-Core 0.16.1's own grad-ready hook (DistributedDataParallel._make_backward_post_hook, called
    unbound on a stand-in for the DDP object with overlap_grad_reduce=True: it asserts param.grad is not None,
    adds param.grad into main_grad unless grad_added_to_main_grad (or zero_out_wgrad), drops param.grad and
    marks the parameter ready for its bucket's reduction), wrapped to record what it saw."""
    from types import SimpleNamespace

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    bucket_group = SimpleNamespace(register_grad_ready=lambda p, force: ready.append(p is param))
    fake_ddp = SimpleNamespace(param_to_bucket_group={param: bucket_group}, force_all_reduce=False,
                               ddp_config=SimpleNamespace(overlap_grad_reduce=True))
    megatron_hook = DistributedDataParallel._make_backward_post_hook(fake_ddp, param)
    seen = []

    def hook(*unused):
        grad = param.grad
        seen.append(None if grad is None else (grad.data_ptr(), tuple(grad.shape), grad.stride()))
        megatron_hook(*unused)

    grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]  # the node DDP registers on
    grad_acc.register_hook(hook)
    return seen, grad_acc


def _ddp_param(weight, tied):
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.randn(w.shape, dtype=torch.float32)  # what earlier micro-batches left there
    w.grad_added_to_main_grad = False  # DistributedDataParallel.__init__ sets it on every trained parameter
    if tied:
        w.zero_out_wgrad = True  # LanguageModule: embedding shared with the output layer on one stage
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_zero_out_wgrad"])
def test_weight_grad_buffer_follows_megatron_grad_added_to_main_grad(dtype, tied):
    """linear_token_logprobs(weight_grad_buffer=weight.main_grad) under Megatron DDP's real grad-ready hook:
    the hook fires once with a defined gradient (overlap_grad_reduce asserts it) and marks the parameter ready,
    that gradient is the weight's own storage (no [V, H] tensor allocated or copied: the old stride-0 zero
    was cloned by AccumulateGrad and then added into main_grad), the weight is untouched, param.grad ends None,
    and main_grad gains exactly d weight (tolerances against float64 as in test_matches_naive). Tied
    (zero_out_wgrad): the embedding's gradient, arriving through the same node, is added once as well."""
    seed = reseed_torch()
    T, H, V = 13, 16, 301
    hidden, weight = torch.randn(T, H).to(dtype), (torch.randn(V, H) / 4).to(dtype)
    target = torch.randint(0, V, (T,))
    g_lp, g_h = torch.randn(T), torch.randn(T)
    ref = _run(K.linear_token_logprobs_ref, hidden.double(), weight.double(), target, g_lp.double(),
               g_h.double())
    naive = _run(K.linear_token_logprobs_ref, hidden, weight, target, g_lp, g_h)

    w = _ddp_param(weight, tied)
    held = w.main_grad.clone()
    ready = []
    seen, _keep = _megatron_hook(w, ready)
    h = hidden.clone().requires_grad_()
    lp, ent = K.linear_token_logprobs(h, w, target, chunk_size=4, with_entropy=True,
                                      weight_grad_buffer=w.main_grad, impl="fused")
    loss = (lp * g_lp.to(lp.dtype) + ent * g_h.to(lp.dtype)).sum()
    lookup_VH = torch.zeros(V, H, dtype=torch.float64).index_add_(0, target, torch.ones(T, H, dtype=torch.float64))
    if tied:
        loss = loss + w[target].sum()  # the embedding lookup of the same parameter
    loss.backward()

    assert ready == [True], f"the grad-ready hook must fire once and mark the weight ready (seed {seed})"
    assert len(seen) == 1 and seen[0] is not None
    if tied:  # param.grad was the embedding's gradient alone (the kernel returned None): a fresh tensor
        assert seen[0][0] != w.data_ptr()
    else:  # the kernel's placeholder, adopted without a copy: the weight's own storage
        assert seen[0] == (w.data_ptr(), (V, H), w.stride()), f"a [V, H] gradient was allocated (seed {seed})"
        assert w.grad_added_to_main_grad is True
    assert w.grad is None
    torch.testing.assert_close(w.detach(), weight, atol=0, rtol=0)  # the placeholder was never written
    d_weight = (w.main_grad - held).double() - (lookup_VH if tied else 0)
    if dtype == torch.bfloat16:
        err = (d_weight - ref[3]).norm()
        naive_err = (naive[3].double() - ref[3]).norm()
        assert err <= LOWP_RATIO * naive_err + LOWP_FLOOR * ref[3].norm(), f"seed {seed}: {err} vs {naive_err}"
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(d_weight, ref[3], atol=max(atol, 1e-6), rtol=rtol,
                                   msg=lambda m: f"seed {seed}: {m}")
        torch.testing.assert_close(h.grad.double(), ref[2], atol=atol, rtol=rtol, msg=lambda m: f"seed {seed}: {m}")


def test_weight_grad_buffer_of_the_caller_gives_autograd_nothing():
    """A buffer that is not Megatron's main_grad: d weight lands in it and the weight's .grad stays None (the
    old code handed autograd a stride-0 zero that AccumulateGrad materialised as a [V, H] zero tensor)."""
    seed = reseed_torch()
    T, H, V = 7, 8, 97
    hidden, weight = torch.randn(T, H), torch.randn(V, H) / 4
    target = torch.randint(0, V, (T,))
    ones, zeros = torch.ones(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    ref = _run(K.linear_token_logprobs_ref, hidden.double(), weight.double(), target, ones, zeros)
    w = torch.nn.Parameter(weight.clone())
    buffer = torch.zeros(V, H)
    lp = K.linear_token_logprobs(hidden, w, target, chunk_size=3, weight_grad_buffer=buffer, impl="fused")
    lp.sum().backward()
    assert w.grad is None
    assert not hasattr(w, "grad_added_to_main_grad")
    torch.testing.assert_close(buffer.double(), ref[3], atol=2e-5, rtol=1e-4, msg=lambda m: f"seed {seed}: {m}")


def test_addmm_out_dtype_probe_and_fallback_agree():
    """The float32 accumulation of bf16 products: torch's addmm(out_dtype=float32) where the probe finds it
    (CUDA), the block-wise fallback elsewhere (this CPU torch has no CPU kernel for it). Both stay within the
    bf16 tolerance of the float64 product and never round the accumulator."""
    seed = reseed_torch()
    C, V, H = 9, 37, 8
    g, h = torch.randn(C, V).bfloat16(), torch.randn(C, H).bfloat16()
    acc = torch.randn(V, H)
    want = acc.double() + g.double().t() @ h.double()
    probed = K._addmm_out_dtype_ok(g.device, g.dtype)
    if g.device.type == "cpu":
        assert probed in (False, True)  # whatever this torch offers; the result below is what matters
    K._add_weight_grad(acc, g, h)
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), want, atol=1e-2, rtol=2.0**-7, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_zero_out_wgrad"])
def test_weight_grad_buffer_megatron_protocol_on_cuda(tied):
    """CUDA: the addmm(out_dtype=float32) accumulation is taken (probe True for bf16) and is at least as
    accurate as the bf16 naive path; the Megatron hook protocol as on the CPU (the hook fires on the device's
    backward thread with the weight's own storage as placeholder)."""
    seed = reseed_torch()
    T, H, V = 300, 64, 5003
    dev = torch.device("cuda")
    hidden, weight = torch.randn(T, H, device=dev).bfloat16(), (torch.randn(V, H, device=dev) / 4).bfloat16()
    target = torch.randint(0, V, (T,), device=dev)
    g_lp, g_h = torch.randn(T, device=dev), torch.randn(T, device=dev)
    assert K._addmm_out_dtype_ok(dev, torch.bfloat16), "torch.addmm(out_dtype=float32) unavailable on CUDA"
    ref = _run(K.linear_token_logprobs_ref, hidden.double(), weight.double(), target, g_lp.double(), g_h.double())
    naive = _run(K.linear_token_logprobs_ref, hidden, weight, target, g_lp, g_h)
    w = _ddp_param(weight, tied)
    w.main_grad = w.main_grad.to(dev)
    held = w.main_grad.clone()
    ready = []
    seen, _keep = _megatron_hook(w, ready)
    lp, ent = K.linear_token_logprobs(hidden, w, target, chunk_size=128, with_entropy=True,
                                      weight_grad_buffer=w.main_grad, impl="auto")
    loss = (lp * g_lp + ent * g_h).sum()
    if tied:
        loss = loss + w[target].float().sum()
    loss.backward()
    torch.cuda.synchronize()
    assert ready == [True] and w.grad is None
    if not tied:
        assert seen[0][0] == w.data_ptr()
    lookup = torch.zeros(V, H, dtype=torch.float64, device=dev).index_add_(
        0, target, torch.ones(T, H, dtype=torch.float64, device=dev))
    d_weight = (w.main_grad - held).double() - (lookup if tied else 0)
    err, naive_err = (d_weight - ref[3]).norm(), (naive[3].double() - ref[3]).norm()
    assert err <= LOWP_RATIO * naive_err + LOWP_FLOOR * ref[3].norm(), f"seed {seed}: {err} vs {naive_err}"
