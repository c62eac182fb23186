"""The update batch's micro-batches: which rows of the rollout batch go together (fixed row counts, or a token
budget balanced by greedy longest-first), and what the model and the loss see of them — one packed stream of
whole sequences (THD, `rl.packing: true`) or right-padded rows (`false`, kept for comparison).

Legend (docs/architecture.md): R rows of this rank's rollout batch, S the padded row length (a multiple of the
sequence-length multiple), T tokens of one packed stream, N sequences of one micro-batch (`_S1` offsets as in
megagspo.algorithm.packing).

A packed stream holds each row's real model-input positions only (prompt + response up to its last token,
minus the final target), row after row; under sequence parallelism its total is rounded up to the multiple of
TP with pad tokens that form a sequence of their own (`cu_seqlens` of the model) and are left out of the router
aux loss and of the loss (`num_loss_tokens`). Padded rows mark every position past the row's length as padding
for the aux loss, so the two layouts route, score and balance exactly the same real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megagspo.policy.megatron_policy import ModelInput
from moe.model import PackedSequences
from moe.parallel import ParallelDims


@dataclass
class PaddedRows:
    """This rank's rollout batch as right-padded rows on the model's device, with each row's real length."""

    input_RS: torch.Tensor
    target_RS: torch.Tensor
    mask_RS: torch.Tensor           # True at target positions holding response tokens
    rollout_logp_RS: torch.Tensor
    lengths_R: torch.Tensor         # real model-input positions of each row (CPU, int64)
    pad_id: int


@dataclass
class MicroInput:
    """What the model and the loss see of one micro-batch, in the micro-batch's own [B, S] layout ([1, T]
    packed): the loss reads the first `num_loss_tokens` positions, flattened, segmented by cu_seqlens_S1."""

    model: ModelInput
    mask_BS: torch.Tensor
    rollout_logp_BS: torch.Tensor
    cu_seqlens_S1: torch.Tensor     # int64 sequence offsets over the flattened positions the loss reads
    num_loss_tokens: int
    valid_T: torch.Tensor           # packed: which of the rows' [rows*S] positions the stream holds (routes)
    real_tokens: int                # real model-input positions (the rest is padding)

    @property
    def computed_tokens(self) -> int:
        return self.model.input_ids_BS.numel()


def row_lengths(prompt_ids: list, response_mask_RL: torch.Tensor) -> torch.Tensor:
    """Model-input positions of each row: prompt + response up to its last real token, minus the final target
    (at least one position)."""
    resp_len = response_mask_RL.shape[1]
    position_L = torch.arange(1, resp_len + 1)
    extent_R = torch.where(response_mask_RL.bool(), position_L, 0).amax(1) if resp_len else torch.zeros(len(prompt_ids))
    lengths = torch.tensor([len(p) for p in prompt_ids]) + extent_R.long() - 1
    return lengths.clamp(min=1)


def micro_input(batch: PaddedRows, rows: torch.Tensor, packed: bool, dims: ParallelDims) -> MicroInput:
    """The model's and the loss's view of `rows` (indices into the batch)."""
    seq_len = batch.input_RS.shape[1]
    lengths = batch.lengths_R[rows]
    valid_RS = torch.arange(seq_len)[None] < lengths[:, None]
    real = int(lengths.sum())
    dev = batch.input_RS.device
    if not packed:
        padding_BS = ~valid_RS.to(dev)
        num_rows = len(rows)
        return MicroInput(
            model=ModelInput(batch.input_RS[rows], batch.target_RS[rows], padding_BS if padding_BS.any() else None),
            mask_BS=batch.mask_RS[rows], rollout_logp_BS=batch.rollout_logp_RS[rows],
            cu_seqlens_S1=torch.arange(num_rows + 1, device=dev) * seq_len, num_loss_tokens=num_rows * seq_len,
            valid_T=valid_RS.reshape(-1), real_tokens=real)
    valid_dev = valid_RS.to(dev)
    total = dims.seq_length(real)
    tail = total - real
    seq_lengths = lengths.tolist() + ([tail] if tail else [])

    def stream(x_RS, fill):
        x_T = x_RS[rows][valid_dev]
        if tail:
            x_T = torch.cat([x_T, x_T.new_full((tail,), fill)])
        return x_T[None]

    padding = None
    if tail:
        padding = (torch.arange(total, device=dev) >= real)[None]
    sequences = PackedSequences.from_lengths(seq_lengths, device=dev)
    return MicroInput(
        model=ModelInput(stream(batch.input_RS, batch.pad_id), stream(batch.target_RS, batch.pad_id), padding,
                         sequences),
        mask_BS=stream(batch.mask_RS, False), rollout_logp_BS=stream(batch.rollout_logp_RS, 0.0),
        # the loss's segments: the real sequences' offsets, without the alignment tail's
        cu_seqlens_S1=sequences.cu_seqlens_N1[:len(rows) + 1].long(), num_loss_tokens=real,
        valid_T=valid_RS.reshape(-1), real_tokens=real)


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
    """rl.max_tokens_per_micro_batch: each mini-batch's rows split into micro-batches of at most `budget`
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
