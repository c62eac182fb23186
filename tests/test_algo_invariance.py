"""Batch normalisation that survives splitting: the same global batch gives the same loss and gradients
whether it is one micro-batch, eight, permuted, or spread over 2 gloo ranks x 4 micro-batches.

A tiny shared "model" (logits = X @ W, log-softmax at the sampled token) makes gradient accumulation
real: micro-batches add into the same W.grad, and data-parallel ranks all-reduce (SUM) it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megagspo.algorithm import PackedBatch, get_loss, merge_metrics
from multiprocess import run_distributed
from test_algo_common import F64, assert_close64, cu_from_lengths, gen, random_lengths  # noqa: F401

D, V = 6, 11
S = 8

# (loss name, config fields): every loss and both GRPO aggregations, with the KL term and the rollout
# correction switched on somewhere so they are covered by the split invariance too.
CASES = [
    ("gspo", {}),
    ("gspo", {"kl": {"coef": 0.1, "estimator": "k3"}, "old_policy": {"correction": {"method": True, "cap": 1.5}}}),
    ("gspo_token", {"kl": {"coef": 0.05, "estimator": "k1"}}),
    ("grpo", {"dual_clip": 2.0}),
    ("grpo", {"aggregation": "token_mean", "kl": {"coef": 0.1}}),
]


def model_logp(W, X_TD, y_T):
    return torch.log_softmax(X_TD @ W, dim=-1).gather(1, y_T[:, None]).squeeze(1)


def make_problem(gen):
    lengths = random_lengths(gen, S, 20, min_len=1)
    lengths[int(torch.randint(0, S, (1,), generator=gen))] = 1  # a one-token sequence
    T = int(lengths.sum())
    seq_id = torch.repeat_interleave(torch.arange(S), lengths)
    X = torch.randn(T, D, generator=gen, dtype=F64)
    y = torch.randint(0, V, (T,), generator=gen)
    W = torch.randn(D, V, generator=gen, dtype=F64) * 0.5
    with torch.no_grad():
        logp = model_logp(W, X, y)
    shift = (torch.rand(S, generator=gen, dtype=F64) * 2 - 1) * 1e-3
    old = logp - shift[seq_id] - 0.05 * torch.randn(T, generator=gen, dtype=F64)
    mask = torch.rand(T, generator=gen) > 0.2
    mask[seq_id == 3] = False  # a fully masked sequence still counts in N
    # Sequence 0 sits inside every clip range (token log-ratios 1e-4, its first token unmasked), so a gradient
    # always flows and the non-vacuity check cannot fail by chance: with the 0.05 token noise alone, each of
    # the 7 live sequences is clipped on its gradient-free side half the time (all 7: ~1% of draws, seen in CI
    # with ALGO_TEST_SEED=1529257291).
    old[seq_id == 0] = logp[seq_id == 0] - 1e-4
    mask[0] = True
    return dict(
        lengths=lengths, X=X, y=y, W=W, old=old, mask=mask,
        rollout=old + 0.3 * torch.randn(T, generator=gen, dtype=F64),
        ref=logp + 0.2 * torch.randn(T, generator=gen, dtype=F64),
        adv_S=torch.randn(S, generator=gen, dtype=F64),
        adv_T=torch.randn(T, generator=gen, dtype=F64),
        entropy=torch.rand(T, generator=gen, dtype=F64),
    )


def _token_slices(problem, seqs):
    cu = cu_from_lengths(problem["lengths"])
    return torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in seqs])


def run_split(problem, name, fields, micro_batches, N, Ntok):
    """Accumulate grads over `micro_batches` (lists of sequence indices); -> (loss sum, W.grad, logp grads
    in the original token order for the covered tokens, metrics of each micro-batch)."""
    W = problem["W"].clone().requires_grad_(True)
    fn = get_loss(name)
    cfg = fn.Config(**fields)
    total = torch.zeros((), dtype=F64)
    tok_grads, tok_index, parts = [], [], []
    for seqs in micro_batches:
        idx = _token_slices(problem, seqs)
        logp = model_logp(W, problem["X"][idx], problem["y"][idx])
        logp.retain_grad()
        pick = lambda k: problem[k][idx]  # noqa: E731
        batch = PackedBatch(
            logp_T=logp, loss_mask_T=pick("mask"), cu_seqlens_S1=cu_from_lengths(problem["lengths"][seqs]),
            num_global_sequences=N, num_global_tokens=Ntok, old_logp_T=pick("old"),
            advantages_S=problem["adv_S"][seqs], advantages_T=None if name == "gspo" else pick("adv_T"),
            ref_logp_T=pick("ref"), rollout_logp_T=pick("rollout"), entropy_T=pick("entropy"),
        )
        loss, metrics = fn(batch, cfg)
        loss.backward()
        total = total + loss.detach()
        tok_grads.append(logp.grad)
        tok_index.append(idx)
        parts.append(metrics)
    idx = torch.cat(tok_index)
    grads = torch.zeros(len(problem["X"]), dtype=F64).index_copy(0, idx, torch.cat(tok_grads))
    return total, W.grad, grads, parts


def _counts(problem):
    return S, int(problem["mask"].sum())


@pytest.mark.parametrize("name,fields", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_one_by_eight_equals_eight_by_one_and_any_permutation(gen, name, fields):
    problem = make_problem(gen)
    N, Ntok = _counts(problem)
    loss1, gW1, g1, parts1 = run_split(problem, name, fields, [list(range(S))], N, Ntok)
    loss8, gW8, g8, parts8 = run_split(problem, name, fields, [[i] for i in range(S)], N, Ntok)
    perm = torch.randperm(S, generator=gen).tolist()
    lossp, gWp, gp, _ = run_split(problem, name, fields, [perm], N, Ntok)
    lossr, gWr, gr, _ = run_split(problem, name, fields, [perm[:3], perm[3:5], perm[5:]], N, Ntok)
    assert bool(gW1.abs().max() > 0)
    for loss, gW, g in ((loss8, gW8, g8), (lossp, gWp, gp), (lossr, gWr, gr)):
        assert_close64(loss, loss1)
        assert_close64(gW, gW1)
        assert_close64(g, g1)
    # Metrics merged over micro-batches equal the whole batch's (counts and count-weighted means).
    merged = merge_metrics(parts8)
    for key, value in parts1[0].items():
        assert_close64(merged[key], value, msg=key)


def _dp_body(rank, world_size, problem, cases, reference):
    """Each rank owns S/world_size sequences in 4 single-sequence micro-batches."""
    per_rank = S // world_size
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    cu_list = [cu_from_lengths(problem["lengths"][[i]]) for i in mine]
    masks = [problem["mask"][_token_slices(problem, [i])] for i in mine]
    # the global normalisers, summed over the data-parallel ranks as the trainer does
    counts = torch.tensor([float(len(cu_list)), float(sum(int(m.sum()) for m in masks))], dtype=torch.float64)
    dist.all_reduce(counts, group=dist.group.WORLD)
    N, Ntok = counts[0], counts[1]
    assert (int(N), int(Ntok)) == _counts(problem), (N, Ntok)
    out = []
    for name, fields in cases:
        loss, gW, g, _ = run_split(problem, name, fields, [[i] for i in mine], N, Ntok)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        dist.all_reduce(gW, op=dist.ReduceOp.SUM)
        out.append((loss, gW, g[_token_slices(problem, mine)]))
    return out


@pytest.mark.multiprocess
def test_two_gloo_ranks_by_four_micro_batches_equal_the_single_process_batch(gen):
    problem = make_problem(gen)
    N, Ntok = _counts(problem)
    reference = [run_split(problem, name, fields, [list(range(S))], N, Ntok) for name, fields in CASES]
    results = run_distributed(_dp_body, world_size=2, args=(problem, CASES, None), timeout_s=120)
    for rank, rank_out in enumerate(results):
        mine = _token_slices(problem, list(range(rank * S // 2, (rank + 1) * S // 2)))
        for (name, _), (loss, gW, g_local), (loss_ref, gW_ref, g_ref, _) in zip(CASES, rank_out, reference):
            assert_close64(loss, loss_ref, msg=f"{name} loss on rank {rank}")
            assert_close64(gW, gW_ref, msg=f"{name} W.grad on rank {rank}")
            assert_close64(g_local, g_ref[mine], msg=f"{name} token grads on rank {rank}")
