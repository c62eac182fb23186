"""Importance ratios on packed sequences: token log-ratios (eq. 3) and the sequence ratio (eq. 8).

Legend (docs/architecture.md): T packed tokens, N packed sequences (spelled `_S` in names here; `_S1`: the N + 1 offsets).

Everything stays in the log domain until the final exp: s_i = exp(m_i) with m_i the masked MEAN
log-ratio, never a product of token ratios (which under/overflows after a few hundred tokens). In float32,
exp(m) is finite for m < ~88.7, so log-ratios of +-50 are safe at any length; nothing is clamped.
Positions outside the response mask are replaced by 0 with `where` (not multiplied by the mask), so a
-inf or NaN log-prob on a prompt/pad token cannot turn into inf*0 = NaN in the forward or the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .packing import as_bool_mask, compute_dtype, segment_ids, segment_sum


def token_log_ratio(logp_T: Tensor, old_logp_T: Tensor, loss_mask_T: Tensor) -> Tensor:
    """log w_t = log pi_theta(y_t) - log pi_old(y_t) (eq. 3, in logs); 0 outside the response."""
    dtype = compute_dtype(logp_T)
    mask_T = as_bool_mask(loss_mask_T)
    diff_T = logp_T.to(dtype) - old_logp_T.detach().to(dtype)
    return torch.where(mask_T, diff_T, torch.zeros((), dtype=dtype, device=diff_T.device))


def masked_segment_mean(x_T: Tensor, mask_T: Tensor, seq_id_T: Tensor, num_sequences: int) -> tuple[Tensor, Tensor]:
    """(sum_t mask x / max(|y_i|, 1), |y_i|) per sequence; x_T must already be 0 outside the mask."""
    lengths_S = segment_sum(mask_T.to(x_T.dtype), seq_id_T, num_sequences)
    return segment_sum(x_T, seq_id_T, num_sequences) / lengths_S.clamp(min=1.0), lengths_S


def response_lengths(loss_mask_T: Tensor, cu_seqlens_S1: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """|y_i|: number of counted response tokens per sequence (0 for a fully masked sequence)."""
    num_seqs = cu_seqlens_S1.shape[0] - 1
    seq_id_T = segment_ids(cu_seqlens_S1, loss_mask_T.shape[0])
    return segment_sum(as_bool_mask(loss_mask_T).to(dtype), seq_id_T, num_seqs)


def sequence_log_ratio(
    logp_T: Tensor, old_logp_T: Tensor, loss_mask_T: Tensor, cu_seqlens_S1: Tensor
) -> tuple[Tensor, Tensor]:
    """m_i = sum_t mask * (logp - old_logp) / max(|y_i|, 1)  ->  (log_ratio_S, lengths_S).

    log s_i of eq. 8. A fully masked sequence gets m_i = 0 (s_i = 1) and length 0.
    """
    seq_id_T = segment_ids(cu_seqlens_S1, logp_T.shape[0])
    log_ratio_T = token_log_ratio(logp_T, old_logp_T, loss_mask_T)
    return masked_segment_mean(log_ratio_T, as_bool_mask(loss_mask_T), seq_id_T, cu_seqlens_S1.shape[0] - 1)


def sequence_ratio(logp_T: Tensor, old_logp_T: Tensor, loss_mask_T: Tensor, cu_seqlens_S1: Tensor) -> Tensor:
    """s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp(m_i)   (eq. 8)."""
    log_ratio_S, _ = sequence_log_ratio(logp_T, old_logp_T, loss_mask_T, cu_seqlens_S1)
    return torch.exp(log_ratio_S)
