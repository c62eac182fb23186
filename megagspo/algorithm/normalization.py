"""Global batch counts: the normalisers that make a split batch's loss and gradients exact.

Legend: T = packed tokens, S = sequences, S1 = S + 1 offsets.

Each rank counts the sequences and response tokens of ALL its micro-batches for one optimizer step, then
the counts are summed over the data-parallel group passed in (communication kept apart from the loss,
group explicit). Every micro-batch loss divides by these, and the trainer SUMS gradients over micro-
batches and over data-parallel ranks (a DDP that averages over ranks must be compensated by scaling the
loss by the data-parallel world size).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .packing import as_bool_mask


def local_batch_counts(loss_masks_T: Sequence[Tensor], cu_seqlens_S1s: Sequence[Tensor]) -> Tensor:
    """[num_sequences, num_response_tokens] over this rank's micro-batches, as a float64 tensor."""
    if len(loss_masks_T) != len(cu_seqlens_S1s):
        raise ValueError(f"{len(loss_masks_T)} loss masks but {len(cu_seqlens_S1s)} cu_seqlens")
    if not loss_masks_T:
        raise ValueError("local_batch_counts needs at least one micro-batch")
    device = loss_masks_T[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mask_T, cu_S1 in zip(loss_masks_T, cu_seqlens_S1s):
        counts[0] += cu_S1.shape[0] - 1
        counts[1] += as_bool_mask(mask_T).sum().to(torch.float64)
    return counts


def global_batch_counts(
    loss_masks_T: Sequence[Tensor],
    cu_seqlens_S1s: Sequence[Tensor],
    *,
    group: Optional["dist.ProcessGroup"] = None,
) -> tuple[Tensor, Tensor]:
    """-> (num_global_sequences, num_global_tokens) as 0-dim float64 tensors (no host sync).

    `group=None` means no data parallelism (counts stay local); pass the data-parallel group otherwise.
    """
    counts = local_batch_counts(loss_masks_T, cu_seqlens_S1s)
    if group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return counts[0], counts[1]
