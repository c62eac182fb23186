"""pi_old from the rollout engine (paper §5.4) and the sequence-level rollout importance correction."""

from __future__ import annotations

import math

import pytest
import torch

from megagspo.algorithm import (
    GSPOConfig,
    OldPolicyConfig,
    PackedBatch,
    get_loss,
    gspo_sequence_loss,
    RolloutCorrectionConfig,
    rollout_correction_weights,
)
from test_algo_common import F64, assert_close64, cu_from_lengths, gen, leaf, random_packed  # noqa: F401


def _batch(b, logp, **kw):
    return PackedBatch(logp_T=logp, loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=len(b["adv"]),
                       advantages_S=b["adv"], **kw)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_rollout_source_uses_rollout_logprobs_as_pi_old(gen, name):
    b = random_packed(gen, num_seqs=10, max_len=12)
    rollout = b["old"] + 1e-4 * torch.randn(len(b["old"]), generator=gen, dtype=F64)
    lp1, lp2 = leaf(b["logp"]), leaf(b["logp"])
    fn = get_loss(name)
    # No recomputed old_logp_T at all: the recompute pass is skipped.
    loss1, _ = fn(_batch(b, lp1, rollout_logp_T=rollout), fn.Config(old_policy={"source": "rollout"}))
    loss2, _ = fn(_batch(b, lp2, old_logp_T=rollout), fn.Config())
    loss1.backward()
    loss2.backward()
    assert_close64(loss1, loss2)
    assert_close64(lp1.grad, lp2.grad)
    with pytest.raises(ValueError, match="source='rollout' but the batch has no rollout_logp_T"):
        fn(_batch(b, lp1, old_logp_T=b["old"]), fn.Config(old_policy={"source": "rollout"}))
    with pytest.raises(ValueError, match="source='recompute' but the batch has no old_logp_T"):
        fn(_batch(b, lp1, rollout_logp_T=rollout), fn.Config())


def test_correction_uses_exp_of_mean_not_exp_of_sum(gen):
    # A per-token train/inference gap delta on a 3,000-token response: the weight is exp(delta)
    # (~1.001), not exp(3000 * delta) (~20, NeMo-RL's bug, docs/architecture.md).
    lengths = torch.tensor([3000, 1, 500])
    cu = cu_from_lengths(lengths)
    T = int(cu[-1])
    seq_id = torch.repeat_interleave(torch.arange(3), lengths)
    delta = torch.tensor([1e-3, -0.2, 5e-4], dtype=F64)
    old = -torch.rand(T, generator=gen, dtype=F64)
    rollout = old - delta[seq_id]
    mask = torch.ones(T, dtype=torch.bool)
    w, m = rollout_correction_weights(old, rollout, mask, cu, cap=2.0)
    assert_close64(w, torch.exp(delta))
    assert float(m["rollout_is/truncated_frac"]) == 0.0
    assert_close64(m["rollout_is/max"], torch.exp(delta).max())


def test_correction_is_truncated_in_log_domain_and_counted(gen):
    lengths = torch.tensor([4, 4, 4, 4])
    cu = cu_from_lengths(lengths)
    seq_id = torch.repeat_interleave(torch.arange(4), lengths)
    gap = torch.tensor([5.0, 1000.0, -1000.0, 0.1], dtype=F64)  # exp(1000) would overflow even float64
    old = -torch.rand(16, generator=gen, dtype=F64)
    w, m = rollout_correction_weights(old, old - gap[seq_id], torch.ones(16, dtype=torch.bool), cu, cap=1.5)
    assert_close64(w, torch.tensor([1.5, 1.5, 0.0, math.exp(0.1)], dtype=F64), atol=1e-300)
    assert float(m["rollout_is/truncated_frac"]) == pytest.approx(0.5, abs=1e-15)


def test_correction_weights_scale_each_sequence_and_carry_no_gradient(gen):
    b = random_packed(gen, num_seqs=12, max_len=20)
    old = b["old"].clone().requires_grad_(True)  # must not receive a gradient through the weight
    rollout = b["old"] + 0.05 * torch.randn(len(b["old"]), generator=gen, dtype=F64)
    lp_c, lp_0 = leaf(b["logp"]), leaf(b["logp"])
    cfg = GSPOConfig(old_policy=OldPolicyConfig(correction=RolloutCorrectionConfig(True, cap=1.02)))
    loss_c, m = get_loss("gspo")(_batch(b, lp_c, old_logp_T=old, rollout_logp_T=rollout), cfg)
    loss_c.backward()
    assert old.grad is None or bool((old.grad == 0).all())
    w, _ = rollout_correction_weights(b["old"], rollout, b["mask"], b["cu"], cap=1.02)
    assert bool((w <= 1.02).all()) and float(m["rollout_is/max"]) <= 1.02
    # Per-sequence weighting: equal to the uncorrected loss with weights given explicitly...
    loss_w, _ = gspo_sequence_loss(lp_0, b["old"], b["mask"], b["cu"], b["adv"], num_global_sequences=12,
                                   seq_weights_S=w)
    loss_w.backward()
    assert_close64(loss_c, loss_w)
    assert_close64(lp_c.grad, lp_0.grad)
    # ...and each sequence's gradient is w_i times the uncorrected one.
    lp_u = leaf(b["logp"])
    gspo_sequence_loss(lp_u, b["old"], b["mask"], b["cu"], b["adv"], num_global_sequences=12)[0].backward()
    assert_close64(lp_c.grad, lp_u.grad * w[b["seq_id"]])


def test_correction_config_rules():
    with pytest.raises(ValueError, match="needs source='recompute'"):
        OldPolicyConfig(source="rollout", correction=RolloutCorrectionConfig(True))
    assert OldPolicyConfig().source == "recompute" and OldPolicyConfig().correction.method == "none"
    assert RolloutCorrectionConfig(True).method == "seq_tis"  # earlier recipes' true
