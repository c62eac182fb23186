"""Token-balanced data parallelism (with rl.batch.max_tokens_per_micro_batch): each mini-batch's sequences are
re-partitioned over the data-parallel ranks so that every rank holds the same number of them and nearly the same
number of tokens, since the slowest rank sets the step's pace.

Each rank generated and scored its own prompts' groups (advantages are per group, computed before this), so the
mini-batch is global: the union of every rank's chunk k. Its sequences are assigned longest first, each to the
rank with the fewest tokens that still has room (greedy longest-first with equal counts, as verl's balanced
partition keeps counts equal: equal counts keep the number of micro-batches a rank can form at least the count
every rank must run). Then the sequences move: every rank learns every sequence's length (a few numbers per
sequence), and each sequence's declared per-token and per-sequence tensors (SequenceBatch: tokens, masks, the
engine's log-probs, its advantage, and where present the engine's routes and the tokens' policy versions) travel once, from the rank that generated it to the rank that keeps it (one all-to-all per
tensor, split sizes from the lengths); nothing is gathered that a rank does not keep. Losses divide by global
counts and the step's metrics are unions over the ranks, so which rank computes which sequence changes nothing but
the time (tests/test_packing.py).

Legend (docs/architecture.md): R sequences per rank, T tokens, Ly MoE layers, K top-k.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from megagspo.rl.batch import SequenceBatch
from megagspo.rl.micro_batches import longest_first_groups
from moe.parallel import ParallelDims


def equal_count_longest_first(lengths: List[int], parts: int) -> List[List[int]]:
    """Items (by index) into `parts` groups of len(lengths) / parts items each, token counts nearly equal:
    longest first, each to the lightest group with room. Ties go to the lower index: every rank computes the
    same assignment."""
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} sequences do not split into {parts} equal groups")
    return longest_first_groups(lengths, parts, room=len(lengths) // parts)


def balance_over_dp(dims: ParallelDims, seqs: SequenceBatch, mini_rows: List[torch.Tensor]):
    """-> (this rank's SequenceBatch after the exchange, per mini-batch the indices into it)."""
    num_rows = seqs.num_sequences
    lengths_all = [int(n) for per_rank in dims.dp_gather([float(n) for n in seqs.lengths]) for n in per_rank]
    minis_all = dims.dp_gather([float(i) for chunk in mini_rows for i in chunk])
    sizes = [len(chunk) for chunk in mini_rows]
    owner = {}  # global sequence id (rank * R + local index) -> the rank that keeps it
    mine: List[List[int]] = []
    for k in range(len(mini_rows)):
        start = sum(sizes[:k])
        members = [r * num_rows + int(i) for r in range(dims.dp_size) for i in minis_all[r][start:start + sizes[k]]]
        groups = equal_count_longest_first([lengths_all[g] for g in members], dims.dp_size)
        for rank, group in enumerate(groups):
            owner.update({members[i]: rank for i in group})
        mine.append([members[i] for i in groups[dims.dp_rank]])
    # what this rank sends, destination by destination, and what it receives, source by source (global order)
    me = dims.dp_rank
    send = [[i for i in range(num_rows) if owner[me * num_rows + i] == dest] for dest in range(dims.dp_size)]
    recv = [[g for g in sorted(owner) if owner[g] == me and g // num_rows == src] for src in range(dims.dp_size)]
    outgoing = seqs.select([i for ids in send for i in ids])
    token_send = [sum(seqs.lengths[i] for i in ids) for ids in send]
    token_recv = [sum(lengths_all[g] for g in ids) for ids in recv]
    seq_send, seq_recv = [len(ids) for ids in send], [len(ids) for ids in recv]
    # every declared per-token and per-sequence tensor, over the wire from the model's device (NCCL takes no CPU
    # tensors), back where it was
    dev = seqs.tokens_T.device
    counts = {"token": (token_send, token_recv), "sequence": (seq_send, seq_recv)}
    moved = {}
    for f in dataclasses.fields(seqs):
        x = getattr(seqs, f.name)
        if f.metadata.get("per") in counts and isinstance(x, torch.Tensor):
            sent, received = counts[f.metadata["per"]]
            moved[f.name] = dims.dp_all_to_all(getattr(outgoing, f.name).to(dev), sent, received).to(x.device)
    arrived = [g for ids in recv for g in ids]
    row_len = max(int(r[0]) for r in dims.dp_gather([float(seqs.row_len)]))  # padded rows hold any rank's longest
    received = dataclasses.replace(seqs, **moved, lengths=[lengths_all[g] for g in arrived], row_len=row_len)
    # in the order of the assignment: mini-batch by mini-batch, each group's members in order
    position = {g: i for i, g in enumerate(arrived)}
    ordered = received.select([position[g] for chunk in mine for g in chunk])
    offsets = [0]
    for chunk in mine:
        offsets.append(offsets[-1] + len(chunk))
    return ordered, [torch.arange(a, b) for a, b in zip(offsets[:-1], offsets[1:])]
