"""Packed (THD) layout: segment ids and sums from `cu_seqlens`, padded <-> packed, the batch structure.

Legend (docs/architecture.md): T packed tokens, N packed sequences, spelled `_S` in names here (`cu_seqlens_S1`:
the N + 1 offsets, starts at 0, last == T); B rows and L response length of the padded layout [B, L].

Segment reductions use `index_add` on segment ids, never a Python loop over sequences, and build the
ids with `repeat_interleave(..., output_size=T)` so no device-to-host sync is needed for the size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

Count = Union[int, float, Tensor]


def compute_dtype(x: Tensor) -> torch.dtype:
    """Ratios are formed in at least float32: bf16 log-ratio means would round away the 3e-4 clip range."""
    return torch.promote_types(x.dtype, torch.float32)


def segment_ids(cu_seqlens_S1: Tensor, num_tokens: int) -> Tensor:
    """seq_id_T[t] = index of the sequence that owns packed token t."""
    lengths_S = cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]
    num_seqs = lengths_S.shape[0]
    return torch.repeat_interleave(
        torch.arange(num_seqs, device=cu_seqlens_S1.device), lengths_S.long(), output_size=num_tokens
    )


def segment_sum(x_T: Tensor, seq_id_T: Tensor, num_sequences: int) -> Tensor:
    """Differentiable per-sequence sum (out-of-place index_add keeps autograd)."""
    return torch.zeros(num_sequences, dtype=x_T.dtype, device=x_T.device).index_add(0, seq_id_T, x_T)


def as_bool_mask(loss_mask_T: Tensor) -> Tensor:
    return loss_mask_T if loss_mask_T.dtype == torch.bool else loss_mask_T != 0


def broadcast_to_tokens(values_S: Tensor, cu_seqlens_S1: Tensor, num_tokens: int) -> Tensor:
    """Per-sequence values (e.g. advantages_S) repeated onto each sequence's packed tokens."""
    return values_S[segment_ids(cu_seqlens_S1, num_tokens)]


def padded_to_packed(x_BL: Tensor) -> tuple[Tensor, Tensor]:
    """Pack a padded [B, L] tensor row by row, keeping every position (padding stays, masked by
    loss_mask). Keeping the padding avoids a data-dependent size, so no host sync."""
    if x_BL.dim() != 2:
        raise ValueError(f"padded tensor must be [B, L], got shape {tuple(x_BL.shape)}")
    rows, length = x_BL.shape
    cu_seqlens_S1 = torch.arange(rows + 1, device=x_BL.device, dtype=torch.int64) * length
    return x_BL.reshape(-1), cu_seqlens_S1


def packed_to_padded(x_T: Tensor, cu_seqlens_S1: Tensor, max_len: int, pad_value: float = 0.0) -> Tensor:
    """Scatter packed tokens into [S, max_len], padding with `pad_value`. `max_len` is an argument so the
    caller decides whether to sync for it."""
    num_tokens = x_T.shape[0]
    num_seqs = cu_seqlens_S1.shape[0] - 1
    seq_id_T = segment_ids(cu_seqlens_S1, num_tokens)
    pos_T = torch.arange(num_tokens, device=x_T.device) - cu_seqlens_S1.long()[seq_id_T]
    out_SL = torch.full((num_seqs, max_len), pad_value, dtype=x_T.dtype, device=x_T.device)
    keep_T = pos_T < max_len
    return out_SL.index_put((seq_id_T[keep_T], pos_T[keep_T]), x_T[keep_T])


@dataclass
class PackedBatch:
    """One micro-batch in the packed layout, as every registered loss takes it.

    `num_global_sequences` / `num_global_tokens` count the WHOLE global batch (all micro-batches,
    gradient-accumulation steps and data-parallel ranks): dividing by them, not by local counts, is what
    makes the summed loss and gradients independent of how the batch is split. Gradients must then be
    SUMMED across data-parallel ranks (not averaged). `num_global_tokens` counts response tokens and is
    needed only by GRPO's token-mean aggregation. `advantages_T` may be omitted when `advantages_S` is
    given (token losses broadcast it); `rollout_logp_T` is the inference engine's log-probs (§5.4).
    """

    logp_T: Tensor
    loss_mask_T: Tensor
    cu_seqlens_S1: Tensor
    num_global_sequences: Count
    old_logp_T: Optional[Tensor] = None
    advantages_S: Optional[Tensor] = None
    advantages_T: Optional[Tensor] = None
    num_global_tokens: Optional[Count] = None
    ref_logp_T: Optional[Tensor] = None
    rollout_logp_T: Optional[Tensor] = None
    entropy_T: Optional[Tensor] = None

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_S1.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.logp_T.shape[0]

    @classmethod
    def from_padded(
        cls,
        *,
        logp_BL: Tensor,
        loss_mask_BL: Tensor,
        num_global_sequences: Count,
        old_logp_BL: Optional[Tensor] = None,
        advantages_B: Optional[Tensor] = None,
        advantages_BL: Optional[Tensor] = None,
        num_global_tokens: Optional[Count] = None,
        ref_logp_BL: Optional[Tensor] = None,
        rollout_logp_BL: Optional[Tensor] = None,
        entropy_BL: Optional[Tensor] = None,
    ) -> "PackedBatch":
        """Padded [B, L] -> packed; every row is one sequence and padding is excluded by loss_mask_BL."""
        logp_T, cu_seqlens_S1 = padded_to_packed(logp_BL)

        def pack(name: str, x: Optional[Tensor]) -> Optional[Tensor]:
            if x is None:
                return None
            if x.shape != logp_BL.shape:
                raise ValueError(f"{name} has shape {tuple(x.shape)} but logp_BL has {tuple(logp_BL.shape)}")
            return x.reshape(-1)

        return cls(
            logp_T=logp_T,
            loss_mask_T=pack("loss_mask_BL", loss_mask_BL),
            cu_seqlens_S1=cu_seqlens_S1,
            num_global_sequences=num_global_sequences,
            old_logp_T=pack("old_logp_BL", old_logp_BL),
            advantages_S=advantages_B,
            advantages_T=pack("advantages_BL", advantages_BL),
            num_global_tokens=num_global_tokens,
            ref_logp_T=pack("ref_logp_BL", ref_logp_BL),
            rollout_logp_T=pack("rollout_logp_BL", rollout_logp_BL),
            entropy_T=pack("entropy_BL", entropy_BL),
        )
