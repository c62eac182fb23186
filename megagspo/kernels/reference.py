"""Pure-torch references of every fused kernel in csrc/, and the fallback when megagspo._C is absent.

Legend (docs/architecture.md): T tokens, V vocab (a shard of it under tensor parallelism), H hidden,
N packed sequences (spelled `_S` in names here; `_S1`: the N + 1 offsets).

These are deliberately the naive formulas (they materialise float32 [T, V]); tests compare the fused
kernels against them. The `*_op` functions mirror the signatures of the torch.ops.megagspo ops so the
chunked and vocab-parallel drivers in megagspo/kernels/__init__.py can run on either backend.
"""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the kernels: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------
# Log-prob / entropy: the naive path the fused kernel replaces.
# ---------------------------------------------------------------------------------------------------------
def token_logprobs_ref(logits_TV: Tensor, target_T: Tensor, with_entropy: bool = False):
    """log softmax(logits)[target] (and the entropy -sum p log p) in the accumulation dtype; autograd-able."""
    x_TV = logits_TV.to(acc_dtype(logits_TV.dtype))
    logprobs_TV = torch.log_softmax(x_TV, dim=-1)
    logp_T = logprobs_TV.gather(1, target_T.long().unsqueeze(1)).squeeze(1).clamp(max=0.0)
    if not with_entropy:
        return logp_T
    # H = lse - sum p x, with -inf logits (p = 0) contributing 0 to the sum and to its gradient.
    finite_x_TV = x_TV.masked_fill(x_TV == float("-inf"), 0.0)
    entropy_T = torch.logsumexp(x_TV, dim=-1) - (logprobs_TV.exp() * finite_x_TV).sum(-1)
    return logp_T, entropy_T


def linear_token_logprobs_ref(hidden_TH: Tensor, weight_VH: Tensor, target_T: Tensor, with_entropy: bool = False):
    """Naive linear log-prob: full logits = hidden @ weight^T, then `token_logprobs_ref`."""
    return token_logprobs_ref(hidden_TH @ weight_VH.t(), target_T, with_entropy)


def logprob_forward_op(logits_TV: Tensor, target_T: Tensor, with_entropy: bool, inplace_backward: bool = False):
    """Reference of torch.ops.megagspo.logprob_forward -> (logp_T, entropy_T or [0], lse_T)."""
    x_TV = logits_TV.to(acc_dtype(logits_TV.dtype))
    lse_T = torch.logsumexp(x_TV, dim=-1)
    logp_T = (x_TV.gather(1, target_T.long().unsqueeze(1)).squeeze(1) - lse_T).clamp(max=0.0)
    if with_entropy:
        logp_TV = (x_TV - lse_T.unsqueeze(1)).clamp(min=-1000.0)
        entropy_T = (-(torch.exp(logp_TV) * logp_TV).sum(-1)).clamp(min=0.0)
    else:
        entropy_T = x_TV.new_empty(0)
    return logp_T, entropy_T, lse_T


def logprob_stats_op(logits_TV: Tensor, target_T: Tensor, vocab_start: int, with_entropy: bool):
    """Reference of torch.ops.megagspo.logprob_stats -> (max_T, sumexp_T, sxm_T, target_logit_T)."""
    x_TV = logits_TV.to(acc_dtype(logits_TV.dtype))
    V = x_TV.shape[1]
    max_T = x_TV.amax(-1)
    d_TV = (x_TV - max_T.unsqueeze(1)).clamp(min=-1000.0)
    e_TV = torch.exp(d_TV)
    sumexp_T = e_TV.sum(-1)
    sxm_T = (e_TV * d_TV).sum(-1) if with_entropy else torch.zeros_like(sumexp_T)
    local_T = target_T.long() - vocab_start
    owned_T = (local_T >= 0) & (local_T < V)
    tgt_T = x_TV.gather(1, local_T.clamp(0, V - 1).unsqueeze(1)).squeeze(1)
    return max_T, sumexp_T, sxm_T, torch.where(owned_T, tgt_T, torch.zeros_like(tgt_T))


def logprob_backward_op(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T, vocab_start: int):
    """Reference of torch.ops.megagspo.logprob_backward: g (onehot - p) - g_H p (log p + H)."""
    x_TV = logits_TV.to(acc_dtype(logits_TV.dtype))
    logp_TV = (x_TV - lse_T.unsqueeze(1)).clamp(min=-1000.0)
    p_TV = torch.exp(logp_TV)
    grad_TV = -p_TV * grad_logp_T.unsqueeze(1)
    if grad_entropy_T is not None:
        grad_TV = grad_TV - grad_entropy_T.unsqueeze(1) * p_TV * (logp_TV + entropy_T.unsqueeze(1))
    V = x_TV.shape[1]
    local_T = target_T.long() - vocab_start
    owned_T = (local_T >= 0) & (local_T < V)
    grad_TV.scatter_add_(1, local_T.clamp(0, V - 1).unsqueeze(1),
                         torch.where(owned_T, grad_logp_T, torch.zeros_like(grad_logp_T)).unsqueeze(1))
    return grad_TV.to(logits_TV.dtype)


def logprob_backward_inplace_op(logits_TV, grad_logp_T, grad_entropy_T, target_T, lse_T, entropy_T, vocab_start: int):
    """Reference of torch.ops.megagspo.logprob_backward_ (overwrites the logits with their gradient)."""
    logits_TV.copy_(logprob_backward_op(grad_logp_T, grad_entropy_T, logits_TV, target_T, lse_T, entropy_T,
                                        vocab_start))


# ---------------------------------------------------------------------------------------------------------
# Segmented GSPO (paper eqs. 6, 8, 11).
# ---------------------------------------------------------------------------------------------------------
def gspo_segment_loss_ref(
    logp_T: Tensor,
    old_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_S: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_global_sequences,
):
    """GSPO loss over packed sequences, autograd-able, with the same outputs as the fused op.

    m_i = sum mask (logp - old_logp) / max(sum mask, 1); s_i = exp(m_i) (eq. 8);
    obj_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) (eq. 6), 0 for fully masked sequences;
    loss = -sum_i obj_i / N. Returns (loss, seq_logratio_S, ratio_S, clipped_S).
    """
    acc = acc_dtype(logp_T.dtype)
    S = cu_seqlens_S1.numel() - 1
    T = logp_T.shape[0]
    cu = cu_seqlens_S1.long()
    # seq_id_T: the sequence of each token, S for tokens outside every sequence (dropped below).
    seq_id_T = torch.searchsorted(cu[1:], torch.arange(T, device=logp_T.device), right=True)
    inside_T = (torch.arange(T, device=logp_T.device) >= cu[0]) & (seq_id_T < S)
    w_T = loss_mask_T.to(acc) * inside_T.to(acc)
    d_T = (logp_T.to(acc) - old_logp_T.detach().to(acc)) * w_T
    idx_T = seq_id_T.clamp(max=max(S - 1, 0))
    sum_S = torch.zeros(S, dtype=acc, device=logp_T.device).index_add(0, idx_T, d_T)
    cnt_S = torch.zeros(S, dtype=acc, device=logp_T.device).index_add(0, idx_T, w_T)
    m_S = sum_S / cnt_S.clamp(min=1.0)
    s_S = torch.exp(m_S)
    a_S = advantages_S.detach().to(acc)
    nonempty_S = cnt_S > 0
    obj_S = torch.minimum(s_S * a_S, s_S.clamp(1.0 - clip_low, 1.0 + clip_high) * a_S)
    obj_S = torch.where(nonempty_S, obj_S, torch.zeros_like(obj_S))
    clipped_S = nonempty_S & (((a_S > 0) & (s_S > 1.0 + clip_high)) | ((a_S < 0) & (s_S < 1.0 - clip_low)))
    loss = -obj_S.sum() / num_global_sequences
    return loss, m_S.detach(), s_S.detach(), clipped_S


def gspo_segment_forward_op(logp_T, old_logp_T, loss_mask_T, cu_seqlens_S1, advantages_S, clip_low, clip_high,
                            num_global_sequences):
    """Reference of torch.ops.megagspo.gspo_segment_forward -> (loss, seq_logratio_S, ratio_S, clipped_S, coef_S)."""
    loss, m_S, s_S, clipped_S = gspo_segment_loss_ref(
        logp_T.detach(), old_logp_T, loss_mask_T, cu_seqlens_S1, advantages_S,
        clip_low=clip_low, clip_high=clip_high, num_global_sequences=num_global_sequences)
    acc = acc_dtype(logp_T.dtype)
    cnt_S = _segment_count(loss_mask_T, cu_seqlens_S1, acc)
    a_S = advantages_S.to(acc)
    coef_S = -(a_S * s_S) / cnt_S.clamp(min=1.0) / num_global_sequences
    coef_S = torch.where((cnt_S > 0) & ~clipped_S, coef_S, torch.zeros_like(coef_S))
    return loss, m_S, s_S, clipped_S, coef_S


def gspo_segment_backward_op(grad_loss, coef_S, loss_mask_T, cu_seqlens_S1, out_dtype):
    """Reference of torch.ops.megagspo.gspo_segment_backward: d logp_t = g coef_{seq(t)} mask_t."""
    T = loss_mask_T.shape[0]
    S = coef_S.shape[0]
    cu = cu_seqlens_S1.long()
    pos_T = torch.arange(T, device=loss_mask_T.device)
    seq_id_T = torch.searchsorted(cu[1:], pos_T, right=True)
    inside_T = (pos_T >= cu[0]) & (seq_id_T < S)
    coef_T = coef_S[seq_id_T.clamp(max=max(S - 1, 0))] if S > 0 else torch.zeros(T, dtype=coef_S.dtype)
    grad_T = grad_loss.to(coef_S.dtype) * coef_T * loss_mask_T.to(coef_S.dtype) * inside_T.to(coef_S.dtype)
    return grad_T.to(out_dtype)


def _segment_count(loss_mask_T: Tensor, cu_seqlens_S1: Tensor, acc: torch.dtype) -> Tensor:
    csum = torch.cat([loss_mask_T.new_zeros(1, dtype=acc), loss_mask_T.to(acc).cumsum(0)])
    cu = cu_seqlens_S1.long()
    return csum[cu[1:]] - csum[cu[:-1]]


__all__ = [
    "acc_dtype",
    "gspo_segment_backward_op",
    "gspo_segment_forward_op",
    "gspo_segment_loss_ref",
    "linear_token_logprobs_ref",
    "logprob_backward_inplace_op",
    "logprob_backward_op",
    "logprob_forward_op",
    "logprob_stats_op",
    "token_logprobs_ref",
]

