"""The rollout-correction menu (megagspo.algorithm.rollout_correction) against independent per-sequence loops in
float64 on fresh random packed batches (odd lengths, an empty sequence, masked prompt tokens holding -inf):
each mode's weights, its effect on the gradient under GSPO, GSPO-token and GRPO (the loss value unchanged by
token weights, the gradient scaled), the mismatch metrics, micro-batch merging and the config's spelling."""

from __future__ import annotations

import math

import pytest
import torch

from megagspo.algorithm import PackedBatch
from megagspo.algorithm.losses import GRPOConfig, GSPOConfig, GSPOTokenConfig, grpo, gspo, gspo_token
from megagspo.algorithm.metrics import merge_metrics
from megagspo.algorithm.old_policy import OldPolicyConfig
from megagspo.algorithm.rollout_correction import (ROLLOUT_CORRECTIONS, RolloutCorrectionConfig, apply_token_weights,
                                                    correction_weights,
                                                   mismatch_metrics)

LENGTHS = [5, 1, 9, 0, 4, 7]  # an empty sequence; a one-token one
THRESHOLDS = dict(cap=1.05, seq_mask_low=0.97, seq_mask_high=1.02, token_mask_low=0.9, token_mask_high=1.1,
                  opsm_delta=0.01)


def _batch(seed: int, requires_grad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    num_tokens = int(cu[-1])
    old = -torch.rand(num_tokens, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(num_tokens, generator=gen, dtype=torch.float64) * 0.15
    logp = (old + torch.randn(num_tokens, generator=gen, dtype=torch.float64) * 0.05).requires_grad_(requires_grad)
    mask = torch.rand(num_tokens, generator=gen) < 0.8
    mask[0] = False  # a prompt token, with the -inf a real prompt position may hold
    rollout[0] = -math.inf
    adv = torch.randn(len(LENGTHS), generator=gen, dtype=torch.float64)
    return dict(logp=logp, old=old, rollout=rollout, mask=mask, cu=cu, adv=adv)


def _per_sequence(b):
    """Each sequence's response-token slices (independent of the module's segment helpers)."""
    out = []
    for i in range(len(LENGTHS)):
        lo, hi = int(b["cu"][i]), int(b["cu"][i + 1])
        m = b["mask"][lo:hi]
        out.append((lo, hi, m, b["old"][lo:hi][m] - b["rollout"][lo:hi][m], b["logp"].detach()[lo:hi][m],
                    b["rollout"][lo:hi][m]))
    return out


def _expected(mode, b):
    """(w_S or None, w_T or None) written out from the formulas of the module docstring."""
    t = THRESHOLDS
    n = b["mask"].shape[0]
    if mode in ("token_tis", "token_mask"):
        w = torch.ones(n, dtype=torch.float64)
        for lo, hi, m, d, _, _ in _per_sequence(b):
            idx = torch.arange(lo, hi)[m]
            rho = torch.exp(d)
            w[idx] = torch.clamp(rho, max=t["cap"]) if mode == "token_tis" else \
                ((rho >= t["token_mask_low"]) & (rho <= t["token_mask_high"])).double()
        return None, w
    w = torch.ones(len(LENGTHS), dtype=torch.float64)
    for i, (lo, hi, m, d, logp, rollout) in enumerate(_per_sequence(b)):
        if d.numel() == 0:
            continue
        geo = torch.exp(d.mean())
        if mode == "seq_tis":
            w[i] = min(float(geo), t["cap"])
        elif mode == "seq_mask_geo":
            w[i] = float(t["seq_mask_low"] <= geo <= t["seq_mask_high"])
        else:  # opsm
            w[i] = 0.0 if (b["adv"][i] < 0 and float((rollout - logp).mean()) > t["opsm_delta"]) else 1.0
    return w, None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", [m for m in ROLLOUT_CORRECTIONS if m != "none"])
def test_weights_equal_the_formulas(mode, seed):
    b = _batch(seed)
    w_S, w_T, metrics = correction_weights(RolloutCorrectionConfig(mode, **THRESHOLDS), logp_T=b["logp"],
                                           old_logp_T=b["old"], rollout_logp_T=b["rollout"], loss_mask_T=b["mask"],
                                           cu_seqlens_S1=b["cu"], advantages_S=b["adv"])
    want_S, want_T = _expected(mode, b)
    for got, want in ((w_S, want_S), (w_T, want_T)):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
            assert not got.requires_grad
    # what the metric counts: truncated (TIS: the weight is the cap) or masked (the weight is 0)
    touched = _touched(mode, w_S[torch.tensor(LENGTHS) > 0] if w_S is not None else w_T[b["mask"]])
    key = f"rollout_correction/{mode}/{'token_frac' if w_T is not None else 'seq_frac'}"
    if mode == "seq_tis":  # its metrics keep their earlier names
        key = "rollout_is/truncated_frac"
    assert float(metrics[key]) == pytest.approx(float(touched.double().mean()))


def _touched(mode, weights):
    return weights == THRESHOLDS["cap"] if mode.endswith("tis") else weights == 0


def test_the_menu_acts_on_both_sides_of_its_thresholds():
    """Every mode masks or truncates something on these batches and leaves something alone (the thresholds
    sit inside the spread of the random gaps), so no test above passed on all-ones weights."""
    b = _batch(0)
    for mode in ROLLOUT_CORRECTIONS[1:]:
        w_S, w_T, _ = correction_weights(RolloutCorrectionConfig(mode, **THRESHOLDS), logp_T=b["logp"],
                                         old_logp_T=b["old"], rollout_logp_T=b["rollout"], loss_mask_T=b["mask"],
                                         cu_seqlens_S1=b["cu"], advantages_S=b["adv"])
        touched = _touched(mode, w_S[torch.tensor(LENGTHS) > 0] if w_S is not None else w_T[b["mask"]])
        assert bool(touched.any()) and not bool(touched.all()), mode


LOSSES = [("gspo", gspo, GSPOConfig), ("gspo_token", gspo_token, GSPOTokenConfig), ("grpo", grpo, GRPOConfig)]


@pytest.mark.parametrize("name, loss_fn, config_cls", LOSSES)
@pytest.mark.parametrize("mode", ["token_tis", "token_mask", "seq_mask_geo", "opsm"])
def test_each_loss_gets_the_weights_on_its_gradient(name, loss_fn, config_cls, mode):
    """Token weights: the loss value equals the uncorrected loss bit for bit and d loss / d logp_t is w_t
    times the uncorrected gradient, under all three losses. Sequence weights: each sequence's gradient is
    w_i times the uncorrected one."""
    b = _batch(7)
    batch_of = lambda logp, correction: (  # noqa: E731
        PackedBatch(logp_T=logp, loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=len(LENGTHS),
                    num_global_tokens=float(b["mask"].sum()), old_logp_T=b["old"], rollout_logp_T=b["rollout"],
                    advantages_S=b["adv"]),
        config_cls(old_policy=OldPolicyConfig(correction=RolloutCorrectionConfig(correction, **THRESHOLDS))))
    plain = b["logp"].detach().clone().requires_grad_(True)
    corrected = b["logp"].detach().clone().requires_grad_(True)
    loss_plain, _ = loss_fn(*batch_of(plain, "none"))
    loss_corr, metrics = loss_fn(*batch_of(corrected, mode))
    loss_plain.backward()
    loss_corr.backward()
    want_S, want_T = _expected(mode, b)
    if want_T is not None:
        assert torch.equal(loss_corr.detach(), loss_plain.detach())
        torch.testing.assert_close(corrected.grad, plain.grad * want_T, rtol=1e-12, atol=1e-15)
    else:
        seq_id = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
        torch.testing.assert_close(corrected.grad, plain.grad * want_S[seq_id], rtol=1e-12, atol=1e-15)
    assert "mismatch/k3_kl" in metrics and torch.isfinite(corrected.grad).all()


def test_token_weights_keep_the_value_exactly_and_leave_masked_positions_alone():
    b = _batch(3)
    w = torch.rand(b["mask"].shape[0], dtype=torch.float64)
    logp = b["logp"].detach().clone()
    logp[0] = -math.inf  # a prompt position
    leaf = logp.clone().requires_grad_(True)
    out = apply_token_weights(leaf, w, b["mask"])
    assert torch.equal(out.detach(), logp)
    out[b["mask"]].sum().backward()
    torch.testing.assert_close(leaf.grad, torch.where(b["mask"], w, torch.zeros_like(w)), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 5])
def test_mismatch_metrics_equal_their_definitions(seed):
    b = _batch(seed)
    got = mismatch_metrics(b["old"], b["rollout"], b["mask"])
    d = torch.cat([d for *_, d, _, _ in [(s[0], s[1], s[2], s[3], s[4], s[5]) for s in _per_sequence(b)]])
    assert float(got["mismatch/abs_log_ratio"]) == pytest.approx(float(d.abs().mean()), rel=1e-12)
    # k3 of KL(pi_rollout || pi_old), samples from pi_rollout: r - 1 - log r with r = pi_old / pi_rollout
    r = torch.exp(d)
    assert float(got["mismatch/k3_kl"]) == pytest.approx(float((r - 1 - torch.log(r)).mean()), rel=1e-10)
    assert float(got["mismatch/frac_over_ln2"]) == pytest.approx(float((d.abs() > math.log(2)).double().mean()))


@pytest.mark.parametrize("seed", [1, 7])
def test_the_fields_mismatch_metrics_equal_their_definitions(seed):
    """F(tau = 5), NeMo-RL's token_mult_prob_error (mean exp|d|) and the token IS weights' moments, whose ratio is
    the effective sample size (Kish: (sum w)^2 / (n sum w^2)), in float64 against their formulas; identical
    log-probs give F = 0, an error of exactly 1 and an ESS of 1."""
    from megagspo.rl.step_metrics import metrics_row

    b = _batch(seed)
    got = mismatch_metrics(b["old"], b["rollout"], b["mask"])
    d = (b["old"] - b["rollout"]).double()[b["mask"]]
    w = torch.exp(d)
    assert float(got["mismatch/frac_over_ln5"]) == pytest.approx(float((d.abs() > math.log(5)).double().mean()))
    assert float(got["mismatch/token_mult_prob_error"]) == pytest.approx(float(torch.exp(d.abs()).mean()), rel=1e-10)
    assert float(got["mismatch/is_weight_mean"]) == pytest.approx(float(w.mean()), rel=1e-10)
    assert float(got["mismatch/is_weight_sq_mean"]) == pytest.approx(float((w * w).mean()), rel=1e-10)
    kish = float(w.sum() ** 2 / (len(w) * (w * w).sum()))
    union = {"seq/clip_frac": 0.0, "tok/clip_frac": 0.0, "seq/clip_low_frac": 0.0, "seq/clip_high_frac": 0.0,
             "kl/approx_old": 0.0, "ratio/mean": 1.0, "loss": 0.0, **{k: float(v) for k, v in got.items()}}
    total = {k: 1.0 for k in ("rows", "reward", "correct", "reward_errors", "reward_clamped", "reward_timeouts",
                              "nonzero_adv", "response_tokens", "vol_changed", "vol_total")}
    row = metrics_row(total, union, [1.0], 1e-3, with_reference=False)
    assert row["mismatch/is_ess_frac"] == pytest.approx(kish, rel=1e-9) and 0.0 < kish <= 1.0
    same = mismatch_metrics(b["old"], b["old"], b["mask"])
    assert float(same["mismatch/frac_over_ln5"]) == 0.0 and float(same["mismatch/token_mult_prob_error"]) == 1.0
    assert float(same["mismatch/is_weight_mean"]) == float(same["mismatch/is_weight_sq_mean"]) == 1.0


def test_metrics_of_two_micro_batches_merge_as_one_batch():
    b = _batch(11)
    cfg = GSPOConfig(old_policy=OldPolicyConfig(correction=RolloutCorrectionConfig("token_mask", token_mask_low=0.8,
                                                                                    token_mask_high=1.25)))
    cut = int(b["cu"][3])  # sequences 0-2 | 3-5
    parts = []
    for lo, hi, s0, s1 in ((0, cut, 0, 3), (cut, int(b["cu"][-1]), 3, 6)):
        cu = b["cu"][s0:s1 + 1] - b["cu"][s0]
        parts.append(gspo(PackedBatch(logp_T=b["logp"][lo:hi], loss_mask_T=b["mask"][lo:hi], cu_seqlens_S1=cu,
                                      num_global_sequences=6, old_logp_T=b["old"][lo:hi],
                                      rollout_logp_T=b["rollout"][lo:hi], advantages_S=b["adv"][s0:s1]), cfg)[1])
    whole = gspo(PackedBatch(logp_T=b["logp"], loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=6,
                             old_logp_T=b["old"], rollout_logp_T=b["rollout"], advantages_S=b["adv"]), cfg)[1]
    merged = merge_metrics(parts)
    for key in ("mismatch/abs_log_ratio", "mismatch/k3_kl", "mismatch/frac_over_ln2", "mismatch/frac_over_ln5",
                "mismatch/token_mult_prob_error", "mismatch/is_weight_mean", "mismatch/is_weight_sq_mean",
                "rollout_correction/token_mask/token_frac", "rollout_correction/token_mask/seq_frac",
                "rollout_correction/token_mask/weight_mean"):
        torch.testing.assert_close(merged[key], whole[key], rtol=1e-12, atol=1e-15, msg=key)


def test_config_spellings():
    assert RolloutCorrectionConfig(True).method == "seq_tis"
    assert RolloutCorrectionConfig(False).method == "none"
    assert OldPolicyConfig(correction={"method": "token_mask"}).correction == RolloutCorrectionConfig("token_mask")
    with pytest.raises(ValueError, match="RolloutCorrectionConfig.method must be one of none, seq_tis"):
        RolloutCorrectionConfig("icepop")
    with pytest.raises(ValueError, match="needs source='recompute'"):
        OldPolicyConfig(source="rollout", correction=RolloutCorrectionConfig("token_mask"))
    with pytest.raises(ValueError, match="RolloutCorrectionConfig.opsm_delta must be a finite number >= 0"):
        RolloutCorrectionConfig(opsm_delta=-1.0)
    with pytest.raises(ValueError, match="RolloutCorrectionConfig.token_mask_low must be a finite number > 0"):
        RolloutCorrectionConfig(token_mask_low=0.0)
