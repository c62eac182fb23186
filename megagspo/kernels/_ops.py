"""Loading megagspo._C, and the torch.library registrations of its ops: fake (meta) implementations so
torch.compile traces them, and autograd formulas.

Legend (docs/architecture.md): T tokens, V vocab (shard), N packed sequences (spelled `_S` in names here; `_S1`: the N + 1 offsets).

The extension is the one optional heavy dependency of this package; `extension_error()` says why it is
not usable (None when it is) and megagspo/kernels/__init__.py warns once when it falls back.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import acc_dtype

OPS = (
    "logprob_forward",
    "logprob_stats",
    "logprob_backward",
    "logprob_backward_",
    "gspo_segment_forward",
    "gspo_segment_backward",
)


def _load() -> Optional[str]:
    """Import megagspo._C (which registers the ops) and its torch.library registrations; the reason it is not
    usable, or None."""
    try:
        from megagspo import _C  # noqa: F401  (importing registers the ops)
    except ImportError as exc:
        return (f"megagspo._C could not be imported ({exc}); build it with "
                "`python setup.py build_ext --inplace` (or `make ext`)")
    missing = [name for name in OPS if not hasattr(torch.ops.megagspo, name)]
    if missing:
        return f"megagspo._C is stale: it lacks the ops {missing}; rebuild it with `make ext`"
    _register()
    return None


def _device_kernels() -> frozenset:
    if EXTENSION_ERROR is not None:
        return frozenset()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return frozenset(dev for dev, key in (("cpu", "CPU"), ("cuda", "CUDA")) if has("megagspo::logprob_forward", key))


def extension_error() -> Optional[str]:
    """None when megagspo._C is importable and registers every op; otherwise the reason it is not usable."""
    return EXTENSION_ERROR


def has_device_kernel(device: torch.device) -> bool:
    """Whether the loaded extension has kernels for `device` (CUDA kernels only in CUDA builds)."""
    return device.type in DEVICE_KERNELS


# ---------------------------------------------------------------------------------------------------------
# Registrations (run once, when the extension is first found usable).
# ---------------------------------------------------------------------------------------------------------
# Over 60 lines: one fake (meta) implementation per op of megagspo._C, each a few lines, registered together.
def _register() -> None:
    lib = "megagspo::"

    @torch.library.register_fake(lib + "logprob_forward")
    def _(logits_TV, target_T, with_entropy, inplace_backward=False):
        T = logits_TV.shape[0]
        acc = acc_dtype(logits_TV.dtype)
        return (logits_TV.new_empty(T, dtype=acc), logits_TV.new_empty(T if with_entropy else 0, dtype=acc),
                logits_TV.new_empty(T, dtype=acc))

    @torch.library.register_fake(lib + "logprob_stats")
    def _(logits_TV, target_T, vocab_start, with_entropy):
        T = logits_TV.shape[0]
        acc = acc_dtype(logits_TV.dtype)
        return tuple(logits_TV.new_empty(T, dtype=acc) for _ in range(4))

    @torch.library.register_fake(lib + "logprob_backward")
    def _(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T, vocab_start):
        return torch.empty_like(logits_TV)

    @torch.library.register_fake(lib + "logprob_backward_")
    def _(logits_TV, grad_logp_T, grad_entropy_T, target_T, lse_T, entropy_T, vocab_start):
        return None

    @torch.library.register_fake(lib + "gspo_segment_forward")
    def _(logp_T, old_logp_T, loss_mask_T, cu_seqlens_S1, advantages_S, clip_low, clip_high, num_global_sequences):
        S = cu_seqlens_S1.shape[0] - 1
        acc = acc_dtype(logp_T.dtype)
        return (logp_T.new_empty((), dtype=acc), logp_T.new_empty(S, dtype=acc), logp_T.new_empty(S, dtype=acc),
                logp_T.new_empty(S, dtype=torch.bool), logp_T.new_empty(S, dtype=acc))

    @torch.library.register_fake(lib + "gspo_segment_backward")
    def _(grad_loss, coef_S, loss_mask_T, cu_seqlens_S1, out_dtype):
        return loss_mask_T.new_empty(loss_mask_T.shape[0], dtype=out_dtype)

    # ---- autograd: log-prob -----------------------------------------------------------------------------
    def logprob_setup(ctx, inputs, output):
        logits_TV, target_T, with_entropy, inplace_backward = (tuple(inputs) + (False,))[:4]
        _, entropy_T, lse_T = output
        ctx.with_entropy = with_entropy
        ctx.inplace_backward = inplace_backward
        ctx.save_for_backward(logits_TV, target_T, lse_T, entropy_T if with_entropy else None)

    def logprob_backward(ctx, grad_logp_T, grad_entropy_T, _grad_lse_T):
        logits_TV, target_T, lse_T, entropy_T = ctx.saved_tensors
        acc = lse_T.dtype
        if grad_logp_T is None:
            grad_logp_T = lse_T.new_zeros(lse_T.shape)
        grad_logp_T = grad_logp_T.to(acc).contiguous()
        if ctx.with_entropy and grad_entropy_T is not None:
            grad_entropy_T = grad_entropy_T.to(acc).contiguous()
        else:
            grad_entropy_T, entropy_T = None, None
        if ctx.inplace_backward:
            torch.ops.megagspo.logprob_backward_(logits_TV, grad_logp_T, grad_entropy_T, target_T, lse_T,
                                                 entropy_T, 0)
            # The logits now hold their gradient: make autograd refuse any other saved use of them.
            torch.autograd.graph.increment_version(logits_TV)
            grad_TV = logits_TV
        else:
            grad_TV = torch.ops.megagspo.logprob_backward(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T,
                                                          entropy_T, 0)
        return grad_TV, None, None, None

    torch.library.register_autograd(lib + "logprob_forward", logprob_backward, setup_context=logprob_setup)

    # ---- autograd: GSPO ----------------------------------------------------------------------------------
    def gspo_setup(ctx, inputs, output):
        logp_T, _old, loss_mask_T, cu_seqlens_S1 = inputs[:4]
        ctx.out_dtype = logp_T.dtype
        ctx.save_for_backward(output[4], loss_mask_T, cu_seqlens_S1)

    def gspo_backward(ctx, grad_loss, *_metric_grads):
        coef_S, loss_mask_T, cu_seqlens_S1 = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 8
        grad_T = torch.ops.megagspo.gspo_segment_backward(grad_loss.to(coef_S.dtype), coef_S, loss_mask_T,
                                                          cu_seqlens_S1, ctx.out_dtype)
        return (grad_T,) + (None,) * 7

    torch.library.register_autograd(lib + "gspo_segment_forward", gspo_backward, setup_context=gspo_setup)


# Decided once, at import: constants (so torch.compile traces the dispatch decision without graph breaks).
EXTENSION_ERROR: Optional[str] = _load()
DEVICE_KERNELS: frozenset = _device_kernels()
