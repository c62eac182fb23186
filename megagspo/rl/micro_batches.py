"""The update batch's micro-batches: which sequences of the rollout batch go together (fixed counts, or a token
budget balanced by greedy longest-first). What the model and the loss see of them: megagspo.rl.batch.

Legend (docs/architecture.md): R sequences of this rank's rollout batch; a micro-batch is a set of them.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from moe.parallel import ParallelDims


def micro_slices(rows: int, micro_batch_size: int) -> list:
    """Row slices of the micro-batches of `rows` sequences on a rank (micro_batch_size 0 = all in one)."""
    size = micro_batch_size or rows
    return [slice(i, i + size) for i in range(0, rows, size)]


def longest_first_groups(lengths: List[int], parts: int, room: Optional[int] = None) -> List[List[int]]:
    """Greedy longest-first (LPT) partition of items (by index) into `parts` groups of nearly equal token counts:
    each item, longest first, joins the lightest group (with `room`: the lightest that holds fewer than `room`
    items). Within 4/3 of the optimal largest group and a single sort; Karmarkar-Karp balances slightly better
    but the gap is below one sequence's length, which a token budget tolerates anyway. Ties go to the lower
    index, so every rank computes the same groups; each group lists its items in index order."""
    loads, groups = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min((p for p in range(parts) if room is None or len(groups[p]) < room), key=lambda p: (loads[p], p))
        loads[g] += lengths[i]
        groups[g].append(i)
    return [sorted(g) for g in groups]


def longest_first(rows: torch.Tensor, lengths: torch.Tensor, parts: int) -> List[torch.Tensor]:
    """`rows` in `parts` longest-first groups by their `lengths` (longest_first_groups); none is empty
    (parts <= len(rows)); each keeps the rows' original order."""
    return [rows[g] for g in longest_first_groups([int(n) for n in lengths], parts)]


def token_budget_split(mini_rows: List[torch.Tensor], lengths_R: torch.Tensor, budget: int,
                       dims: ParallelDims) -> List[List[torch.Tensor]]:
    """rl.batch.max_tokens_per_micro_batch: each mini-batch's rows split into micro-batches of at most `budget`
    tokens (a sequence longer than the budget gets one of its own), balanced by tokens. Every data-parallel rank
    runs the same number of micro-batches, the count the fullest rank needs, as expert-parallel all-to-alls
    and the pipeline schedule require."""
    needed = [float(_parts_within(lengths_R[rows], budget)) for rows in mini_rows]
    counts = [max(col) for col in zip(*dims.dp_gather(needed))]
    return [longest_first(rows, lengths_R[rows], min(int(m), len(rows))) for rows, m in zip(mini_rows, counts)]


def _parts_within(lengths: torch.Tensor, budget: int) -> int:
    """The fewest longest-first groups whose token counts all fit the budget (or one row per group)."""
    items = [int(n) for n in lengths]
    for parts in range(max(-(-sum(items) // budget), 1), len(items) + 1):
        loads = [sum(items[i] for i in g) for g in longest_first_groups(items, parts)]
        if max(loads) <= max(budget, max(items)):
            return parts
    return len(items)
