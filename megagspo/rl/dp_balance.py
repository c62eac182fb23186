"""Token-balanced data parallelism (with rl.max_tokens_per_micro_batch): each mini-batch's sequences are
re-partitioned over the data-parallel ranks so that every rank holds the same number of them and nearly the same
number of tokens, since the slowest rank sets the step's pace.

Each rank generated and scored its own prompts' groups (advantages are per group, computed before this), so the
mini-batch is global: the union of every rank's chunk k. Its sequences are assigned longest first, each to the
rank with the fewest tokens that still has room (greedy longest-first with equal counts, as verl's balanced
partition keeps counts equal: equal counts keep the number of micro-batches a rank can form at least the count
every rank must run). Then each rank gathers its sequences: the rows of every rank are all-gathered over the
data-parallel group (token ids, masks, the engine's log-probs, advantages and, when the step uses them, the
engine's routes), padded to the longest row. Losses divide by global counts and the step's metrics are unions
over the ranks, so which rank computes which sequence changes nothing but the time (tests/test_packing.py).

Legend (docs/architecture.md): R rows per rank, S row length, P route positions, Ly MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megagspo.rl.micro_batches import PaddedRows, longest_first_groups
from moe.parallel import ParallelDims


@dataclass
class BalancedRows:
    rows: PaddedRows                    # this rank's sequences after the exchange
    advantages_R: torch.Tensor
    routes_RPLyK: Optional[torch.Tensor]
    mini_rows: List[torch.Tensor]       # per mini-batch: indices into `rows`


def equal_count_longest_first(lengths: List[int], parts: int) -> List[List[int]]:
    """Items (by index) into `parts` groups of len(lengths) / parts items each, token counts nearly equal:
    longest first, each to the lightest group with room. Ties go to the lower index: every rank computes the
    same assignment."""
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} sequences do not split into {parts} equal groups")
    return longest_first_groups(lengths, parts, room=len(lengths) // parts)


def _gather_rows(dims: ParallelDims, x: torch.Tensor, fill) -> torch.Tensor:
    """[R, ...] on every rank (trailing sizes may differ in dim 1) -> [dp*R, ...] rank by rank, padded with fill."""
    width = max(int(w[0]) for w in dims.dp_gather([float(x.shape[1])])) if x.dim() > 1 else None
    if width is not None and x.shape[1] < width:
        pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill)
        x = torch.cat([x, pad], dim=1)
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x
    parts = [torch.empty_like(wire) for _ in range(dims.dp_size)]
    dist.all_gather(parts, wire.contiguous(), group=dims.dp_group)
    out = torch.cat(parts)
    return out.bool() if x.dtype == torch.bool else out


def balance_over_dp(dims: ParallelDims, rows: PaddedRows, advantages_R: torch.Tensor,
                    routes_RPLyK: Optional[torch.Tensor], mini_rows: List[torch.Tensor]) -> BalancedRows:
    num_rows = rows.input_RS.shape[0]
    lengths_all = [int(n) for per_rank in dims.dp_gather([float(n) for n in rows.lengths_R]) for n in per_rank]
    minis_all = dims.dp_gather([float(i) for chunk in mini_rows for i in chunk])
    sizes = [len(chunk) for chunk in mini_rows]
    mine: List[List[int]] = []
    for k in range(len(mini_rows)):  # global row id = rank * R + local row
        start = sum(sizes[:k])
        members = [r * num_rows + int(i) for r in range(dims.dp_size) for i in minis_all[r][start:start + sizes[k]]]
        groups = equal_count_longest_first([lengths_all[g] for g in members], dims.dp_size)
        mine.append([members[i] for i in groups[dims.dp_rank]])
    take = torch.tensor([g for chunk in mine for g in chunk], dtype=torch.long)
    dev = rows.input_RS.device
    gathered = [_gather_rows(dims, x, fill) for x, fill in ((rows.input_RS, rows.pad_id), (rows.target_RS, rows.pad_id),
                                                         (rows.mask_RS, False), (rows.rollout_logp_RS, 0.0))]
    input_RS, target_RS, mask_RS, logp_RS = (x[take.to(dev)] for x in gathered)
    advantages = _gather_rows(dims, advantages_R.to(dev), 0.0)[take.to(dev)]
    routes = None
    if routes_RPLyK is not None:  # on the wire as int32 from the model's device (NCCL); back as the engine's
        wire = _gather_rows(dims, routes_RPLyK.to(dev, torch.int32), -1)[take.to(dev)]
        routes = wire.to("cpu", routes_RPLyK.dtype)
    offsets = [0]
    for chunk in mine:
        offsets.append(offsets[-1] + len(chunk))
    balanced = PaddedRows(input_RS, target_RS, mask_RS, logp_RS, torch.tensor(lengths_all)[take], rows.pad_id)
    return BalancedRows(balanced, advantages, routes,
                        [torch.arange(a, b) for a, b in zip(offsets[:-1], offsets[1:])])
