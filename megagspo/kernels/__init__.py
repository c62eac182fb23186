"""Fused kernels: token log-probs (plain, vocab-parallel, chunked from hidden states) and segmented GSPO.

Legend (docs/architecture.md): T tokens, V vocab (the local shard under tensor parallelism), H hidden,
N packed sequences (spelled `_S` in names here; `_S1`: the N + 1 offsets).

    token_logprobs(logits_TV, target_T, *, with_entropy=False, inplace_backward=False,
                   tp_group=None, vocab_start=None, impl="auto")          -> logp_T  (or (logp_T, entropy_T))
    linear_token_logprobs(hidden_TH, weight_VH, target_T, *, chunk_size=1024, with_entropy=False,
                          impl="auto")                                     -> logp_T  (or (logp_T, entropy_T))
    gspo_segment_loss(logp_T, old_logp_T, loss_mask_T, cu_seqlens_S1, advantages_S, *,
                      clip_low=3e-4, clip_high=4e-4, num_global_sequences, impl="auto") -> (loss, metrics)

impl: "fused" (the megagspo._C kernels; error if unavailable), "reference" (pure torch, see
megagspo/kernels/reference.py), "auto" (fused when megagspo._C has kernels for the tensors' device, otherwise
the reference, with ONE warning naming the reason).

The fused log-prob kernels never allocate a float32 [T, V] tensor: forward keeps O(T) statistics (logp,
entropy, log-sum-exp: 12 B per token), backward writes d logits in the logits' dtype in one pass, or, with
`inplace_backward=True`, over the logits themselves (extra memory O(T)). Log-probs are clamped to <= 0.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from moe import cuda_calls
from moe.optimizer import gradient_added_to_main_grad, takes_gradient_in_main_grad

from . import reference
from ._ops import extension_error, has_device_kernel
from .reference import (
    acc_dtype,
    gspo_segment_loss_ref,
    linear_token_logprobs_ref,
    token_logprobs_ref,
)

IMPLS = ("auto", "fused", "reference")


# ---------------------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------------------
class _LogProbBackend(NamedTuple):
    name: str
    forward: Callable  # (logits_TV, target_T, with_entropy) -> (logp_T, entropy_T, lse_T)
    stats: Callable  # (logits_TV, target_T, vocab_start, with_entropy) -> (max, sumexp, sxm, target_logit)
    backward: Callable  # (g_logp, g_entropy, logits, target, lse, entropy, vocab_start) -> d logits
    backward_: Callable  # (logits, g_logp, g_entropy, target, lse, entropy, vocab_start) -> None, in place


def _fused_backend() -> _LogProbBackend:
    ops = torch.ops.megagspo
    return _LogProbBackend("fused", lambda x, y, e: ops.logprob_forward(x, y, e, False), ops.logprob_stats,
                           ops.logprob_backward, ops.logprob_backward_)


_REFERENCE_BACKEND = _LogProbBackend("reference", reference.logprob_forward_op, reference.logprob_stats_op,
                                     reference.logprob_backward_op, reference.logprob_backward_inplace_op)


@functools.lru_cache(maxsize=None)
def _warn_fallback_once(reason: str) -> None:
    warnings.warn(
        f"megagspo.kernels: falling back to the pure-torch reference kernels, which materialise float32 "
        f"[tokens, vocab] tensors and are much slower: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )


def fused_available(device: Union[str, torch.device] = "cpu") -> bool:
    """Whether the fused kernels of megagspo._C can run on `device`."""
    return has_device_kernel(torch.device(device))


def _use_fused(impl: str, device: torch.device) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"megagspo.kernels: impl must be one of {IMPLS}; got {impl!r}")
    if impl == "reference":
        return False
    if has_device_kernel(device):
        return True
    err = extension_error()
    reason = err if err is not None else f"megagspo._C was built without kernels for {device.type} tensors"
    if impl == "fused":
        raise RuntimeError(f"megagspo.kernels: impl='fused' requested but {reason}")
    _warn_fallback_once(reason)
    return False


def _vocab_contiguous(x_TV: Tensor) -> Tensor:
    return x_TV if x_TV.shape[1] <= 1 or x_TV.stride(1) == 1 else x_TV.contiguous()


def _check_same_device(fn: str, ref_name: str, ref: Tensor, **tensors: Optional[Tensor]) -> None:
    """Every tensor argument on the device of `ref`, checked before any kernel runs: the fused ops would
    otherwise be dispatched on the "highest" device among their arguments (CUDA over CPU) and fail there."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"megagspo.kernels.{fn}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                             f"every tensor argument must be on one device ({name}: {tuple(t.shape)} {t.dtype})")


def _check_logits(logits_TV: Tensor, target_T: Tensor, name: str) -> None:
    if logits_TV.dim() != 2 or target_T.dim() != 1 or target_T.shape[0] != logits_TV.shape[0]:
        raise ValueError(f"megagspo.kernels.{name}: expected logits [T, V] and target [T]; got logits "
                         f"{tuple(logits_TV.shape)} {logits_TV.dtype} and target {tuple(target_T.shape)} "
                         f"{target_T.dtype}")
    _check_same_device(name, "logits", logits_TV, target=target_T)


def _num_global_sequences(value, logp_T: Tensor) -> tuple[float, Optional[Tensor]]:
    """-> (the count passed to the kernel, a tensor the loss is divided by afterwards or None).

    A Python number goes to the kernel. A one-element tensor divides the loss afterwards (the kernel then
    gets 1), so a count that lives on the GPU is never read on the host (no sync): it must be on logp's
    device; a CPU tensor is also accepted (it is read on the host, which is free, and checked like a number).
    """
    fn = "gspo_segment_loss"
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"megagspo.kernels.{fn}: num_global_sequences must be a number or a one-element real "
                             f"tensor; got a tensor {tuple(value.shape)} {value.dtype}")
        if value.device.type == "cpu":
            n = float(value.detach().reshape(()))
            if not (math.isfinite(n) and n > 0):
                raise ValueError(f"megagspo.kernels.{fn}: num_global_sequences must be > 0 and finite; got {n}")
        elif value.device != logp_T.device:
            raise ValueError(f"megagspo.kernels.{fn}: num_global_sequences is on {value.device} but logp is on "
                             f"{logp_T.device}; pass it as a number, a CPU tensor or a tensor on logp's device")
        return 1.0, value
    if isinstance(value, bool):
        raise ValueError(f"megagspo.kernels.{fn}: num_global_sequences must be a count, got {value!r}")
    try:
        n = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"megagspo.kernels.{fn}: num_global_sequences must be a number or a one-element tensor; "
                         f"got {value!r}") from None
    if not (math.isfinite(n) and n > 0):
        raise ValueError(f"megagspo.kernels.{fn}: num_global_sequences must be > 0 and finite; got {value!r}")
    return n, None


# ---------------------------------------------------------------------------------------------------------
# Token log-probs
# ---------------------------------------------------------------------------------------------------------
def token_logprobs(
    logits_TV: Tensor,
    target_T: Tensor,
    *,
    with_entropy: bool = False,
    inplace_backward: bool = False,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    impl: str = "auto",
):
    """log softmax(logits_TV)[t, target_T[t]] (<= 0), and optionally the entropy, in float32 (float64 for
    float64 logits); differentiable w.r.t. the logits.

    inplace_backward: the backward writes d logits OVER `logits_TV` and returns it as the gradient, so the
        logits are DESTROYED by `backward()` (no [T, V] gradient buffer is allocated). Only for logits that
        nothing else needs afterwards, e.g. the fresh output of the LM head; refused for leaf tensors.
        Autograd's version counter is bumped, so another node that saved the same logits fails loudly.
    tp_group / vocab_start: vocab-parallel mode. `logits_TV` holds the vocab shard
        [vocab_start, vocab_start + V) of this rank (default vocab_start: rank_in_group * V, Megatron's even
        split); `target_T` holds global ids. Partial (max, sum-exp) are combined with one all_reduce(MAX)
        and one all_reduce(SUM) over `tp_group`; the result equals the TP=1 result on every rank, and each
        rank gets the gradient of its own shard (backward needs no communication). Every target id must lie
        on some shard: it is not checked across ranks (that would need a host sync).
    impl="reference" (and the fallback) ignores `inplace_backward` at TP = 1: autograd's own gradient.
    """
    _check_logits(logits_TV, target_T, "token_logprobs")
    if inplace_backward and logits_TV.requires_grad and logits_TV.is_leaf:
        raise ValueError("megagspo.kernels.token_logprobs: inplace_backward=True would overwrite a leaf tensor "
                         f"({tuple(logits_TV.shape)} {logits_TV.dtype}) with its own gradient; use it only "
                         "for intermediate logits (e.g. the LM-head output)")
    fused = _use_fused(impl, logits_TV.device)
    if tp_group is not None:
        V = logits_TV.shape[1]
        if vocab_start is None:
            vocab_start = dist.get_rank(tp_group) * V
        backend = _fused_backend() if fused else _REFERENCE_BACKEND
        logp_T, entropy_T = _VocabParallelLogProb.apply(_vocab_contiguous(logits_TV), target_T, int(vocab_start),
                                                        with_entropy, inplace_backward, tp_group, backend)
        return (logp_T, entropy_T) if with_entropy else logp_T
    if vocab_start not in (None, 0):
        raise ValueError(f"megagspo.kernels.token_logprobs: vocab_start={vocab_start} needs a tp_group")
    if not fused:
        return token_logprobs_ref(logits_TV, target_T, with_entropy)
    logits_TV = _vocab_contiguous(logits_TV)
    logp_T, entropy_T, _lse_T = torch.ops.megagspo.logprob_forward(logits_TV, target_T, with_entropy,
                                                                   inplace_backward)
    return (logp_T, entropy_T) if with_entropy else logp_T


def all_reduce_logprob_stats(max_T: Tensor, sumexp_T: Tensor, sxm_T: Tensor, target_logit_T: Tensor, *,
                             group: dist.ProcessGroup, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Communication only: the vocab shards' partial statistics -> the global (max, sumexp, sxm, target logit).

    all_reduce(MAX) of the row max, then one all_reduce(SUM) of the rescaled [sumexp, sxm, target logit]
    (sxm = sum exp(x - m) (x - m) shifts to the global max m' as exp(m - m') (sxm + (m - m') sumexp)).
    """
    gmax_T = max_T.clone()
    dist.all_reduce(gmax_T, op=dist.ReduceOp.MAX, group=group)
    shift_T = max_T - gmax_T
    scale_T = torch.exp(shift_T)
    zero = torch.zeros((), dtype=sumexp_T.dtype, device=sumexp_T.device)
    parts = [sumexp_T * scale_T, target_logit_T]
    if with_entropy:
        parts.append(torch.where(sumexp_T > 0, (sxm_T + shift_T * sumexp_T) * scale_T, zero))
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return gmax_T, packed[0], (packed[2] if with_entropy else sxm_T), packed[1]


def finish_logprob_stats(max_T: Tensor, sumexp_T: Tensor, sxm_T: Tensor, target_logit_T: Tensor,
                         with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Global statistics -> (logp_T clamped <= 0, entropy_T or [0], lse_T); H = log s - sxm / s."""
    log_s_T = torch.log(sumexp_T)
    lse_T = max_T + log_s_T
    logp_T = (target_logit_T - lse_T).clamp(max=0.0)
    entropy_T = (log_s_T - sxm_T / sumexp_T).clamp(min=0.0) if with_entropy else lse_T.new_empty(0)
    return logp_T, entropy_T, lse_T


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, target_T, vocab_start, with_entropy, inplace_backward, group, backend):
        stats = backend.stats(logits_TV, target_T, vocab_start, with_entropy)
        stats = all_reduce_logprob_stats(*stats, group=group, with_entropy=with_entropy)
        logp_T, entropy_T, lse_T = finish_logprob_stats(*stats, with_entropy)
        ctx.vocab_start, ctx.with_entropy, ctx.inplace_backward, ctx.backend = (
            vocab_start, with_entropy, inplace_backward, backend)
        ctx.save_for_backward(logits_TV, target_T, lse_T, entropy_T if with_entropy else None)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return logp_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logp_T, grad_entropy_T):
        logits_TV, target_T, lse_T, entropy_T = ctx.saved_tensors
        g_lp = (grad_logp_T if grad_logp_T is not None else torch.zeros_like(lse_T)).to(lse_T.dtype).contiguous()
        if ctx.with_entropy and grad_entropy_T is not None:
            g_h = grad_entropy_T.to(lse_T.dtype).contiguous()
        else:
            g_h, entropy_T = None, None
        if ctx.inplace_backward:
            ctx.backend.backward_(logits_TV, g_lp, g_h, target_T, lse_T, entropy_T, ctx.vocab_start)
            torch.autograd.graph.increment_version(logits_TV)
            grad_TV = logits_TV
        else:
            grad_TV = ctx.backend.backward(g_lp, g_h, logits_TV, target_T, lse_T, entropy_T, ctx.vocab_start)
        return grad_TV, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------
# Chunked linear log-probs: logits recomputed per token chunk, never [T, V] at once
# ---------------------------------------------------------------------------------------------------------
class _LinearLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, target_T, chunk_size, with_entropy, backend, tp_group=None, vocab_start=0,
                weight_grad_buffer=None):
        T = hidden_TH.shape[0]
        acc = acc_dtype(hidden_TH.dtype)
        if tp_group is None:
            logp_T, entropy_T, lse_T = _linear_forward_local(hidden_TH, weight_VH, target_T, chunk_size,
                                                             with_entropy, backend, acc)
        else:
            # vocab shard: partial statistics per chunk into O(T) buffers, then ONE pair of all-reduces for all
            # T tokens (not one per chunk)
            stats = [hidden_TH.new_empty(T, dtype=acc) for _ in range(4)]  # max, sumexp, sxm, target logit
            for c0 in range(0, T, chunk_size):
                c1 = min(c0 + chunk_size, T)
                logits_CV = hidden_TH[c0:c1] @ weight_VH.t()
                for buf_T, part_C in zip(stats, backend.stats(logits_CV, target_T[c0:c1], vocab_start,
                                                              with_entropy)):
                    buf_T[c0:c1] = part_C
                del logits_CV
            stats = all_reduce_logprob_stats(*stats, group=tp_group, with_entropy=with_entropy)
            logp_T, entropy_T, lse_T = finish_logprob_stats(*stats, with_entropy)
        ctx.chunk_size, ctx.with_entropy, ctx.backend, ctx.vocab_start = chunk_size, with_entropy, backend, vocab_start
        ctx.weight_grad_buffer = weight_grad_buffer  # written in backward, not an autograd input
        ctx.save_for_backward(hidden_TH, weight_VH, target_T, lse_T, entropy_T if with_entropy else None)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return logp_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logp_T, grad_entropy_T):
        hidden_TH, weight_VH, target_T, lse_T, entropy_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T = hidden_TH.shape[0]
        g_lp = (grad_logp_T if grad_logp_T is not None else torch.zeros_like(lse_T)).to(lse_T.dtype).contiguous()
        use_h = ctx.with_entropy and grad_entropy_T is not None
        g_h = grad_entropy_T.to(lse_T.dtype).contiguous() if use_h else None
        d_hidden_TH = torch.empty_like(hidden_TH) if need_h else None
        into = ctx.weight_grad_buffer if need_w else None
        # d weight accumulates over chunks: into the caller's buffer, or a fresh one (float32 for low precision)
        d_weight_VH = into if into is not None else (
            torch.zeros(weight_VH.shape, dtype=acc_dtype(weight_VH.dtype), device=weight_VH.device) if need_w else None)
        for c0 in range(0, T, ctx.chunk_size):
            c1 = min(c0 + ctx.chunk_size, T)
            h_CH = hidden_TH[c0:c1]
            logits_CV = h_CH @ weight_VH.t()  # recomputed, then overwritten by its own gradient
            ctx.backend.backward_(logits_CV, g_lp[c0:c1], g_h[c0:c1] if use_h else None, target_T[c0:c1],
                                  lse_T[c0:c1], entropy_T[c0:c1] if use_h else None, ctx.vocab_start)
            if need_h:
                torch.mm(logits_CV, weight_VH, out=d_hidden_TH[c0:c1])
            if need_w:
                _add_weight_grad(d_weight_VH, logits_CV, h_CH)
            del logits_CV
        if into is not None:
            d_weight_VH = _weight_grad_for_autograd(weight_VH, into)
        elif need_w:
            d_weight_VH = d_weight_VH.to(weight_VH.dtype)
        # d hidden is this vocab shard's share: the caller's communication (Megatron's sequence-parallel
        # gather, whose backward reduce-scatters) sums the shards, as it does behind the output layer
        return d_hidden_TH, d_weight_VH, None, None, None, None, None, None, None


# rows of d weight per low-precision product of the fallback: bounds its temporary to ~16 M elements (32 MiB
# in bf16)
_WEIGHT_GRAD_BLOCK_ELEMENTS = 1 << 24

# (device type, operand dtype) -> whether torch.addmm(..., out_dtype=torch.float32, out=<float32 self>)
# works and accumulates in float32 there (probed once; CUDA in torch >= 2.8 for bf16 / fp16, not the CPU)
_ADDMM_OUT_DTYPE: dict = {}


def _addmm_out_dtype_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(acc32, a, b, out_dtype=torch.float32, out=acc32)` with low-precision a, b is
    supported on this device type (the kernel exists: CUDA's `_addmm_dtype_out_cuda`; the CPU has none in
    torch 2.13) and accepts a float32 `self` (torch versions differ: some require self in the operands'
    dtype). Probed once per (device type, dtype) on a 2x3 @ 3x2 product checked against float64: any error
    or a wrong answer selects the block-wise fallback."""
    key = (device.type, dtype)
    ok = _ADDMM_OUT_DTYPE.get(key)
    if ok is None:
        ok = False
        try:
            a = torch.tensor([[1.0, 2.0, -1.0], [0.5, 3.0, 2.0]], dtype=dtype, device=device)
            b = torch.tensor([[1.0, -2.0], [0.25, 1.0], [4.0, 0.5]], dtype=dtype, device=device)
            acc = torch.full((2, 2), 0.125, dtype=torch.float32, device=device)
            out = cuda_calls.addmm_out_dtype(acc, a, b)
            want = torch.full((2, 2), 0.125, dtype=torch.float64) + a.double().cpu() @ b.double().cpu()
            ok = bool(out.data_ptr() == acc.data_ptr() and out.dtype == torch.float32
                      and torch.equal(acc.double().cpu(), want))
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _ADDMM_OUT_DTYPE[key] = ok
    return ok


def _add_weight_grad(d_weight_VH: Tensor, g_CV: Tensor, h_CH: Tensor) -> None:
    """d_weight_VH += g_CV^T h_CH. Same dtype: one in-place addmm. A float32 accumulator of bf16 / fp16
    operands: where torch has it (CUDA), ONE GEMM with bf16 operands, float32 accumulation and a float32
    output (`addmm(..., out_dtype=torch.float32)`, beta = 1 into the accumulator itself: no temporary, the
    products never rounded to bf16); elsewhere (the CPU) the product in the operands' dtype, block by block
    over V, added into float32 (no [V, H] temporary; each product rounded to bf16 once before the add)."""
    if d_weight_VH.dtype == g_CV.dtype:
        d_weight_VH.addmm_(g_CV.t(), h_CH)
        return
    if d_weight_VH.dtype == torch.float32 and _addmm_out_dtype_ok(g_CV.device, g_CV.dtype):
        cuda_calls.addmm_out_dtype(d_weight_VH, g_CV.t(), h_CH)
        return
    V, H = d_weight_VH.shape
    block = max(1, _WEIGHT_GRAD_BLOCK_ELEMENTS // max(H, 1))
    for v0 in range(0, V, block):
        v1 = min(v0 + block, V)
        d_weight_VH[v0:v1].add_(g_CV[:, v0:v1].t() @ h_CH)


def _weight_grad_for_autograd(weight_VH: Tensor, buffer_VH: Tensor) -> Optional[Tensor]:
    """What backward hands autograd for the weight once d weight is in `buffer_VH`: never a [V, H] tensor
    that costs an allocation or a pass over memory.

    - Megatron DDP's own buffer (`buffer_VH is weight.main_grad`) of a weight whose hook honours
      `grad_added_to_main_grad`: Megatron's protocol, `moe.optimizer.gradient_added_to_main_grad` (the flag
      set, a detached alias of the weight returned).
    - `zero_out_wgrad` (the embedding shared with the output layer on one pipeline stage): that hook adds
      `param.grad` whatever the flag says, and the embedding's own gradient arrives through the same node, so
      this returns None: `param.grad` is the embedding's gradient alone, added once, and ours is already in
      main_grad.
    - Any other buffer (the caller's own accumulator, no DDP hook): None; the weight's `.grad` receives
      nothing from this call (other uses of the weight still accumulate theirs)."""
    if buffer_VH is getattr(weight_VH, "main_grad", None) and takes_gradient_in_main_grad(weight_VH):
        return gradient_added_to_main_grad(weight_VH)
    return None


def _linear_forward_local(hidden_TH, weight_VH, target_T, chunk_size, with_entropy, backend, acc):
    """The whole vocabulary on this rank: the fused forward per chunk -> (logp_T, entropy_T, lse_T)."""
    T = hidden_TH.shape[0]
    logp_T = hidden_TH.new_empty(T, dtype=acc)
    lse_T = hidden_TH.new_empty(T, dtype=acc)
    entropy_T = hidden_TH.new_empty(T if with_entropy else 0, dtype=acc)
    for c0 in range(0, T, chunk_size):
        c1 = min(c0 + chunk_size, T)
        logits_CV = hidden_TH[c0:c1] @ weight_VH.t()
        lp, ent, lse = backend.forward(logits_CV, target_T[c0:c1], with_entropy)
        logp_T[c0:c1], lse_T[c0:c1] = lp, lse
        if with_entropy:
            entropy_T[c0:c1] = ent
        del logits_CV
    return logp_T, entropy_T, lse_T


def linear_token_logprobs(
    hidden_TH: Tensor,
    weight_VH: Tensor,
    target_T: Tensor,
    *,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    weight_grad_buffer: Optional[Tensor] = None,
    impl: str = "auto",
):
    """Token log-probs of logits = hidden_TH @ weight_VH^T, computed `chunk_size` tokens at a time.

    Forward keeps only O(T) statistics; backward recomputes each chunk's logits, overwrites them with their
    gradient (fused kernel, in place) and accumulates d hidden and d weight, so the extra peak memory is
    O(chunk_size x V) instead of O(T x V). impl="reference" is the naive full-logits path; the fallback of
    impl="auto" without the extension runs the same chunking on the reference ops.

    tp_group / vocab_start: vocab-parallel mode, as in `token_logprobs`: `weight_VH` holds the rows
        [vocab_start, vocab_start + V) of the LM head (default vocab_start: rank_in_group * V), `hidden_TH`
        the same tokens on every rank, `target_T` global ids. Each chunk's partial (max, sum-exp, ...) stay
        on the rank until one all_reduce(MAX) and one all_reduce(SUM) over all T tokens. The gradient w.r.t.
        hidden_TH is this shard's PARTIAL d hidden: sum it over the group (Megatron's sequence-parallel
        all-gather does, in its backward reduce-scatter; see moe.output_hidden). Backward communicates nothing.
    weight_grad_buffer: a [V, H] tensor (float32, or the weight's dtype) that backward ADDS d weight into,
        e.g. Megatron DDP's float32 `main_grad` of the LM head: no [V, H] gradient is allocated (for bf16
        weights not even a float32 accumulator; on CUDA one bf16 GEMM per chunk accumulates in float32
        straight into it). What autograd then receives for `weight_VH` (see _weight_grad_for_autograd):
        for the buffer `weight_VH.main_grad` of a Megatron DDP parameter, Megatron's protocol
        (`grad_added_to_main_grad` set, a free placeholder gradient its hook drops; None with
        `zero_out_wgrad`); for any other buffer, None (the weight's .grad gets nothing from this call).
        The buffer must not be read before backward finishes.
    """
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"megagspo.kernels.linear_token_logprobs: expected hidden [T, H] and weight [V, H]; got "
                         f"{tuple(hidden_TH.shape)} and {tuple(weight_VH.shape)}")
    if target_T.dim() != 1 or target_T.shape[0] != hidden_TH.shape[0]:
        raise ValueError(f"megagspo.kernels.linear_token_logprobs: target must be [T={hidden_TH.shape[0]}]; got "
                         f"{tuple(target_T.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"megagspo.kernels.linear_token_logprobs: chunk_size must be >= 1 (an integer); got "
                         f"{chunk_size!r}")
    if hidden_TH.dtype != weight_VH.dtype:
        raise ValueError(f"megagspo.kernels.linear_token_logprobs: hidden is {hidden_TH.dtype} but weight is "
                         f"{weight_VH.dtype}; the LM-head product needs one dtype")
    _check_same_device("linear_token_logprobs", "hidden", hidden_TH, weight=weight_VH, target=target_T)
    if tp_group is None and vocab_start not in (None, 0):
        raise ValueError(f"megagspo.kernels.linear_token_logprobs: vocab_start={vocab_start} needs a tp_group")
    if tp_group is not None and vocab_start is None:
        vocab_start = dist.get_rank(tp_group) * weight_VH.shape[0]
    if weight_grad_buffer is not None:
        if weight_grad_buffer.shape != weight_VH.shape or weight_grad_buffer.dtype not in (
                torch.float32, weight_VH.dtype) or weight_grad_buffer.device != weight_VH.device:
            raise ValueError(f"megagspo.kernels.linear_token_logprobs: weight_grad_buffer must be a float32 (or "
                             f"{weight_VH.dtype}) tensor of the weight's shape {tuple(weight_VH.shape)} on "
                             f"{weight_VH.device}; got {tuple(weight_grad_buffer.shape)} {weight_grad_buffer.dtype} "
                             f"on {weight_grad_buffer.device}")
        if impl == "reference":
            raise ValueError("megagspo.kernels.linear_token_logprobs: weight_grad_buffer needs the chunked kernel; "
                             "impl='reference' is the naive autograd path")
    if impl == "reference":
        if tp_group is None:
            return linear_token_logprobs_ref(hidden_TH, weight_VH, target_T, with_entropy)
        return token_logprobs(hidden_TH @ weight_VH.t(), target_T, with_entropy=with_entropy, tp_group=tp_group,
                              vocab_start=vocab_start, impl="reference")
    backend = _fused_backend() if _use_fused(impl, hidden_TH.device) else _REFERENCE_BACKEND
    logp_T, entropy_T = _LinearLogProb.apply(hidden_TH, weight_VH, target_T, chunk_size, with_entropy, backend,
                                             tp_group, 0 if tp_group is None else int(vocab_start), weight_grad_buffer)
    return (logp_T, entropy_T) if with_entropy else logp_T


# ---------------------------------------------------------------------------------------------------------
# Segmented GSPO loss
# ---------------------------------------------------------------------------------------------------------
def gspo_segment_loss(
    logp_T: Tensor,
    old_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_S: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_global_sequences: Union[int, float, Tensor],
    impl: str = "auto",
) -> tuple[Tensor, dict]:
    """GSPO loss over packed sequences in one kernel launch each way (no host sync, no loop over sequences).

    Per sequence i: m_i = sum_t mask (logp - old_logp) / max(sum_t mask, 1), s_i = exp(m_i) (eq. 8),
    obj_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) (eq. 6), 0 for a fully masked sequence;
    loss = -sum_i obj_i / num_global_sequences; d loss / d logp_t = -(1/N) A_i s_i mask_t / |y_i| [not
    clipped] (eq. 11). Accumulates in float32 (float64 for float64 logp). Gradients flow to logp_T only.

    num_global_sequences: a positive number, or a one-element tensor on logp's device (never read on the
    host: no sync) or on the CPU. Every tensor argument must be on logp's device; bad arguments raise before
    any kernel runs (ValueError here, RuntimeError from the op's own checks in csrc/checks.h).

    Returns (loss, metrics) with tensor metrics: seq_logratio_S (m_i), ratio_S (s_i), clipped_S (bool),
    clip_fraction (over sequences).
    """
    if impl not in IMPLS:
        raise ValueError(f"megagspo.kernels.gspo_segment_loss: impl must be one of {IMPLS}; got {impl!r}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"megagspo.kernels.gspo_segment_loss: need 0 <= clip_low < 1 and clip_high >= 0; got "
                         f"clip_low={clip_low}, clip_high={clip_high}")
    n_value, n_tensor = _num_global_sequences(num_global_sequences, logp_T)
    _check_same_device("gspo_segment_loss", "logp", logp_T, old_logp=old_logp_T, loss_mask=loss_mask_T,
                       cu_seqlens=cu_seqlens_S1, advantages=advantages_S)
    acc = acc_dtype(logp_T.dtype)
    fused = _use_fused(impl, logp_T.device)
    mask_T = loss_mask_T if loss_mask_T.dtype in (torch.bool, logp_T.dtype) else loss_mask_T.to(logp_T.dtype)
    if fused:
        loss, m_S, s_S, clipped_S, _coef_S = torch.ops.megagspo.gspo_segment_forward(
            logp_T.contiguous(), old_logp_T.detach().to(logp_T.dtype).contiguous(), mask_T.contiguous(),
            cu_seqlens_S1.contiguous(), advantages_S.detach().to(acc).contiguous(), float(clip_low),
            float(clip_high), n_value)
    else:
        loss, m_S, s_S, clipped_S = gspo_segment_loss_ref(
            logp_T, old_logp_T, mask_T, cu_seqlens_S1, advantages_S, clip_low=clip_low, clip_high=clip_high,
            num_global_sequences=n_value)
    if n_tensor is not None:
        loss = loss / n_tensor.reshape(()).to(loss.dtype)  # reshape: a [1] count keeps the loss 0-dim
    metrics = {
        "seq_logratio_S": m_S.detach(),
        "ratio_S": s_S.detach(),
        "clipped_S": clipped_S,
        "clip_fraction": clipped_S.to(acc).mean() if clipped_S.numel() else clipped_S.new_zeros((), dtype=acc),
    }
    return loss, metrics


__all__ = [
    "IMPLS",
    "all_reduce_logprob_stats",
    "finish_logprob_stats",
    "fused_available",
    "gspo_segment_loss",
    "gspo_segment_loss_ref",
    "linear_token_logprobs",
    "linear_token_logprobs_ref",
    "token_logprobs",
    "token_logprobs_ref",
]
