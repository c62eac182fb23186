"""SwiGLU times the routing probability in one kernel forward and one backward (`model.expert_activation=fused`,
moe.experts.GroupedGemmExperts' `activation="fused"`).

Shape legend: T routed token copies, I expert FFN width (this expert-TP rank), F = 2 I: fc1's output [gate; up].

What it computes, rounded exactly as Megatron's MLP (and GroupedGemmExperts' unfused path) rounds it, with D the
dtype of fc1 (bf16 in training) and the probabilities in the router's dtype (fp32):
    s = D(silu(gate))            torch's silu on D: computed in fp32, rounded to D
    a = D(s * up)                a D x D product
    out = D(a * probs)           D x fp32 promotes to fp32; Megatron casts the product back to D
and in backward the gradients autograd gives that sequence (g = fp32(d_out)):
    d_a = D(g * probs), d_probs = sum_i g a (fp32), d_up = D(d_a s), d_gate = D(silu'(gate) D(d_a up)).
Only fc1 [T, F] and probs [T] are saved; s and a are recomputed in backward. The unfused path keeps gate's silu,
a, and the fp32 product for backward, and runs ~6 elementwise kernels forward and ~10 backward (the fp32
multiplies and bf16 copies of an H100 profile of the step: 19.6 ms + 15.6 ms per 4-micro-batch step at
Qwen3-30B-A3B width, not all of them from here); the pair here is one read of fc1 and probs and one write each way.

Why exp and division may differ by an ulp or two from torch's fp32 on a GPU (Triton's fast exp / division):
after the rounding to bf16 that rarely shows; the tests hold each dtype to the tolerance table of
tests/test_moe_triton_kernels.py.

`SwigluProbs` runs the Triton kernels on CUDA tensors (and on CPU tensors in Triton's interpreter, for the tests:
moe.triton_support), else its pure-torch reference: the unfused ops recomputed in backward, bit-identical to
the unfused path (the CPU's implementation of `fused`, and the tests' oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.triton_support import INTERPRETED, require_triton, tl, triton

CHOICE = "model.expert_activation=fused"


@dataclass(frozen=True)
class SwigluTiles:
    """Rows x columns per step: 8 x 256 with 4 warps is 16 elements (two 16-byte bf16 vectors) per thread; each
    program walks its rows' I columns in steps of block_i (3 at I = 768), so d_probs is summed in registers."""

    block_t: int = 8
    block_i: int = 256
    num_warps: int = 4


DEFAULT_TILES = SwigluTiles()

if triton is not None:
    @triton.jit
    def _swiglu_probs_fwd_kernel(fc1_ptr, probs_ptr, out_ptr, T, I, stride_fc1, stride_out,
                                 BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_t = rt < T
        p = tl.load(probs_ptr + rt, mask=in_t, other=0.0).to(tl.float32)[:, None]
        fc1_rows = fc1_ptr + rt.to(tl.int64)[:, None] * stride_fc1
        out_rows = out_ptr + rt.to(tl.int64)[:, None] * stride_out
        for i0 in range(0, I, BLOCK_I):
            ri = i0 + tl.arange(0, BLOCK_I)[None, :]
            inside = in_t[:, None] & (ri < I)
            gate = tl.load(fc1_rows + ri, mask=inside, other=0.0).to(tl.float32)
            up = tl.load(fc1_rows + I + ri, mask=inside, other=0.0).to(tl.float32)
            s = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
            a = (s * up).to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_rows + ri, (a * p).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_probs_bwd_kernel(dout_ptr, fc1_ptr, probs_ptr, dfc1_ptr, dprobs_ptr, T, I, stride_dout, stride_fc1,
                                 stride_dfc1, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_t = rt < T
        p = tl.load(probs_ptr + rt, mask=in_t, other=0.0).to(tl.float32)[:, None]
        dout_rows = dout_ptr + rt.to(tl.int64)[:, None] * stride_dout
        fc1_rows = fc1_ptr + rt.to(tl.int64)[:, None] * stride_fc1
        dfc1_rows = dfc1_ptr + rt.to(tl.int64)[:, None] * stride_dfc1
        dp = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            ri = i0 + tl.arange(0, BLOCK_I)[None, :]
            inside = in_t[:, None] & (ri < I)
            g = tl.load(dout_rows + ri, mask=inside, other=0.0).to(tl.float32)
            gate = tl.load(fc1_rows + ri, mask=inside, other=0.0).to(tl.float32)
            up = tl.load(fc1_rows + I + ri, mask=inside, other=0.0).to(tl.float32)
            exp_neg = tl.exp(-gate)
            sig = 1.0 / (1.0 + exp_neg)
            s = (gate / (1.0 + exp_neg)).to(fc1_ptr.dtype.element_ty).to(tl.float32)  # as forward's s
            a = (s * up).to(fc1_ptr.dtype.element_ty).to(tl.float32)
            dp += tl.sum(g * a, axis=1)
            d_a = (g * p).to(fc1_ptr.dtype.element_ty).to(tl.float32)
            d_s = (d_a * up).to(fc1_ptr.dtype.element_ty).to(tl.float32)
            tl.store(dfc1_rows + I + ri, (d_a * s).to(dfc1_ptr.dtype.element_ty), mask=inside)
            # torch's silu_backward: dy * sig * (1 + x * (1 - sig))
            tl.store(dfc1_rows + ri, (d_s * sig * (1.0 + gate * (1.0 - sig))).to(dfc1_ptr.dtype.element_ty),
                     mask=inside)
        tl.store(dprobs_ptr + rt, dp.to(dprobs_ptr.dtype.element_ty), mask=in_t)


def _check(fc1_TF: torch.Tensor, probs_T: torch.Tensor) -> None:
    if fc1_TF.dim() != 2 or fc1_TF.shape[1] % 2 or probs_T.shape != fc1_TF.shape[:1] \
            or fc1_TF.device != probs_T.device or not probs_T.is_floating_point():
        raise ValueError(f"swiglu_probs: fc1 must be [T, 2 I] and probs [T] floats on one device; got fc1 "
                         f"{tuple(fc1_TF.shape)} on {fc1_TF.device}, probs {probs_T.dtype} {tuple(probs_T.shape)} "
                         f"on {probs_T.device}")


def swiglu_probs_forward(fc1_TF: torch.Tensor, probs_T: torch.Tensor,
                         tiles: SwigluTiles = DEFAULT_TILES) -> torch.Tensor:
    """The Triton forward: out_TI = D(D(D(silu(gate)) up) probs) (module docstring), in fc1's dtype."""
    require_triton(CHOICE, fc1_TF.device)
    _check(fc1_TF, probs_T)
    fc1_TF, probs_T = fc1_TF.contiguous(), probs_T.contiguous()
    t, i = fc1_TF.shape[0], fc1_TF.shape[1] // 2
    out_TI = torch.empty((t, i), dtype=fc1_TF.dtype, device=fc1_TF.device)
    if t and i:
        _swiglu_probs_fwd_kernel[(triton.cdiv(t, tiles.block_t),)](
            fc1_TF, probs_T, out_TI, t, i, fc1_TF.stride(0), out_TI.stride(0),
            BLOCK_T=tiles.block_t, BLOCK_I=tiles.block_i, num_warps=tiles.num_warps)
    return out_TI


def swiglu_probs_backward(dout_TI: torch.Tensor, fc1_TF: torch.Tensor, probs_T: torch.Tensor,
                          tiles: SwigluTiles = DEFAULT_TILES) -> tuple:
    """The Triton backward: (d fc1_TF in fc1's dtype, d probs_T in probs' dtype), recomputing s and a."""
    require_triton(CHOICE, fc1_TF.device)
    _check(fc1_TF, probs_T)
    dout_TI, fc1_TF, probs_T = dout_TI.contiguous(), fc1_TF.contiguous(), probs_T.contiguous()
    t, i = fc1_TF.shape[0], fc1_TF.shape[1] // 2
    if dout_TI.shape != (t, i):
        raise ValueError(f"swiglu_probs_backward: d_out {tuple(dout_TI.shape)} for fc1 {tuple(fc1_TF.shape)}")
    dfc1_TF = torch.empty_like(fc1_TF)
    dprobs_T = torch.zeros_like(probs_T)  # I = 0: nothing summed
    if t and i:
        _swiglu_probs_bwd_kernel[(triton.cdiv(t, tiles.block_t),)](
            dout_TI, fc1_TF, probs_T, dfc1_TF, dprobs_T, t, i, dout_TI.stride(0), fc1_TF.stride(0),
            dfc1_TF.stride(0), BLOCK_T=tiles.block_t, BLOCK_I=tiles.block_i, num_warps=tiles.num_warps)
    return dfc1_TF, dprobs_T


def swiglu_probs_reference(fc1_TF: torch.Tensor, probs_T: torch.Tensor) -> torch.Tensor:
    """The unfused torch ops of Megatron's MLP (GroupedGemmExperts._activation with SwiGLU, then the probability
    product cast back): the oracle of the kernels and the CPU's implementation."""
    gate_TI, up_TI = torch.chunk(fc1_TF, 2, dim=-1)
    act_TI = torch.nn.functional.silu(gate_TI) * up_TI
    return (act_TI * probs_T.unsqueeze(-1)).to(fc1_TF.dtype)


def uses_triton(device: torch.device) -> bool:
    """Whether `fused` runs the Triton kernels on `device` (CUDA; the CPU in Triton's interpreter only); raises
    ImplementationError on CUDA where Triton does not import."""
    device = torch.device(device)
    if device.type == "cuda" or INTERPRETED:
        require_triton(CHOICE, device)
        return True
    return False


class SwigluProbs(torch.autograd.Function):
    """out_TI = SwiGLU(fc1_TF) x probs_T as Megatron rounds it, saving only fc1_TF and probs_T for backward.
    `use_triton`: the Triton kernels, else the pure-torch reference recomputed under autograd in backward."""

    @staticmethod
    def forward(ctx, fc1_TF, probs_T, use_triton: bool):
        ctx.save_for_backward(fc1_TF, probs_T)
        ctx.use_triton = use_triton
        if use_triton:
            return swiglu_probs_forward(fc1_TF, probs_T)
        return swiglu_probs_reference(fc1_TF, probs_T)

    @staticmethod
    def backward(ctx, dout_TI):
        fc1_TF, probs_T = ctx.saved_tensors
        if ctx.use_triton:
            dfc1_TF, dprobs_T = swiglu_probs_backward(dout_TI, fc1_TF, probs_T)
        else:
            with torch.enable_grad():
                fc1_TF, probs_T = fc1_TF.detach().requires_grad_(True), probs_T.detach().requires_grad_(True)
                out_TI = swiglu_probs_reference(fc1_TF, probs_T)
                dfc1_TF, dprobs_T = torch.autograd.grad(out_TI, (fc1_TF, probs_T), dout_TI)
        return (dfc1_TF if ctx.needs_input_grad[0] else None,
                dprobs_T if ctx.needs_input_grad[1] else None, None)
