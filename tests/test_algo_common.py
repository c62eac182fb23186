"""Shared helpers for the algorithm-core tests: fresh random packed batches and naive references.

Every test draws a new seed and prints it (shown by pytest on failure) so a failing draw can be
replayed with ALGO_TEST_SEED=<seed>. The references here loop over sequences in plain Python, float64,
independently of the vectorised code under test.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

F64 = torch.float64


@pytest.fixture
def gen():
    seed = int(os.environ.get("ALGO_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"ALGO_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def random_lengths(gen, num_seqs, max_len, min_len=1):
    return torch.randint(min_len, max_len + 1, (num_seqs,), generator=gen)


def cu_from_lengths(lengths_S):
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths_S.long(), 0)])


def random_packed(gen, *, num_seqs=16, max_len=24, seq_shift=1.5e-3, token_noise=2e-3, dtype=F64,
                  empty_seq=True):
    """A packed batch whose sequence ratios straddle GSPO's 3e-4/4e-4 clip range on both sides.

    Each sequence has a prompt prefix (masked out), a per-sequence log-ratio shift U(-seq_shift, seq_shift)
    and per-token noise; with empty_seq, one sequence is fully masked.
    """
    lengths = random_lengths(gen, num_seqs, max_len, min_len=2)
    cu = cu_from_lengths(lengths)
    T = int(cu[-1])
    seq_id = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    logp = -torch.rand(T, generator=gen, dtype=F64) * 4.0 - 0.01
    shift = (torch.rand(num_seqs, generator=gen, dtype=F64) * 2 - 1) * seq_shift
    old = logp - shift[seq_id] - token_noise * torch.randn(T, generator=gen, dtype=F64)
    pos = torch.arange(T) - cu[seq_id]
    prompt = torch.randint(0, 3, (num_seqs,), generator=gen)
    prompt = torch.minimum(prompt, lengths - 1)
    mask = pos >= prompt[seq_id]
    if empty_seq:
        mask[seq_id == int(torch.randint(0, num_seqs, (1,), generator=gen))] = False
    adv = torch.randn(num_seqs, generator=gen, dtype=F64)
    return dict(logp=logp.to(dtype), old=old.to(dtype), mask=mask, cu=cu, adv=adv.to(dtype), seq_id=seq_id)


def ref_sequence_stats(logp, old, mask, cu):
    """Per sequence: (s_i, |y_i|) by an explicit loop, float64."""
    s, n = [], []
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        sel = mask[a:b]
        cnt = int(sel.sum())
        m = float((logp[a:b].double() - old[a:b].double())[sel].sum()) / max(cnt, 1)
        s.append(math.exp(m))
        n.append(cnt)
    return s, n


def ref_gspo_grad(logp, old, mask, cu, adv, N, clip_low=3e-4, clip_high=4e-4):
    """Closed form of eq. 11 with the clip indicator: -(1/N) A_i s_i / |y_i| on unclipped responses."""
    s, n = ref_sequence_stats(logp, old, mask, cu)
    grad = torch.zeros(len(logp), dtype=F64)
    clipped = []
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        A = float(adv[i])
        c = (A > 0 and s[i] > 1 + clip_high) or (A < 0 and s[i] < 1 - clip_low)
        clipped.append(c and n[i] > 0)
        if n[i] == 0 or c:
            continue
        grad[a:b][mask[a:b]] = -A * s[i] / n[i] / N
    return grad, clipped


def ref_gspo_loss(logp, old, mask, cu, adv, N, clip_low=3e-4, clip_high=4e-4):
    """Eq. 6 literally: -(1/N) sum_i min(s_i A_i, clip(s_i) A_i), empty sequences contribute 0."""
    s, n = ref_sequence_stats(logp, old, mask, cu)
    total = 0.0
    for i in range(len(cu) - 1):
        if n[i] == 0:
            continue
        A = float(adv[i])
        total += min(s[i] * A, min(max(s[i], 1 - clip_low), 1 + clip_high) * A)
    return -total / N


def every_input_batch(name, t, logp_T, num_global_sequences, num_global_tokens):
    """(PackedBatch, Config) of loss `name` with every optional input on: the KL reference, pi_old recomputed with
    the rollout correction, the entropy; `t` holds random_packed's tensors (on any device), logp_T the policy's."""
    from megagspo.algorithm import KLConfig, PackedBatch, get_loss

    cfg = get_loss(name).Config(validate=False, kl=KLConfig(coef=0.1),
                                old_policy={"source": "recompute", "correction": {"method": True}})
    batch = PackedBatch(logp_T=logp_T, loss_mask_T=t["mask"], cu_seqlens_S1=t["cu"],
                        num_global_sequences=num_global_sequences, old_logp_T=t["old"], advantages_S=t["adv"],
                        ref_logp_T=t["old"], rollout_logp_T=t["old"], entropy_T=t["old"],
                        num_global_tokens=num_global_tokens)
    return batch, cfg


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def assert_close64(actual, expected, rtol=1e-10, atol=1e-13, msg=""):
    """float64 identities: relative 1e-10 with an absolute floor far below any entry's scale."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=msg or None)


def test_reference_helpers_agree_with_each_other(gen):
    # The reference loss's finite-difference slope matches the reference closed-form gradient,
    # so later tests compare the implementation with a reference that is itself right.
    b = random_packed(gen, num_seqs=6, max_len=6)
    N = 6
    grad, _ = ref_gspo_grad(b["logp"], b["old"], b["mask"], b["cu"], b["adv"], N)
    h = 1e-7
    for t in torch.nonzero(b["mask"]).flatten()[:6].tolist():
        up, dn = b["logp"].clone(), b["logp"].clone()
        up[t] += h
        dn[t] -= h
        fd = (ref_gspo_loss(up, b["old"], b["mask"], b["cu"], b["adv"], N)
              - ref_gspo_loss(dn, b["old"], b["mask"], b["cu"], b["adv"], N)) / (2 * h)
        # Central differences in float64 with h=1e-7 are good to ~1e-8 (unless a clip edge lies within h).
        assert abs(fd - float(grad[t])) <= 1e-7 * max(1.0, abs(fd)), (t, fd, float(grad[t]))
