"""The rollout-correction menu: what the loss does about the gap between the policy that sampled a batch (the
rollout engine's per-token log-probs, pi_rollout: another kernel stack, another precision, or weights one update
old) and the recomputed pi_old that the loss's ratio starts from; and the metrics that show that gap.

Legend (docs/architecture.md): T packed tokens, N packed sequences (spelled `_S`; `_S1`: the N + 1 offsets).
Per response token, d_t = log pi_old(y_t) - log pi_rollout(y_t) (both constants), rho_t = exp(d_t); per
sequence the length-normalised log ratio m_i = mean_t d_t (as s_i of GSPO eq. 8 is for pi_theta / pi_old).

  none          no correction
  seq_tis       w_i = min(exp(m_i), C)                       sequence truncated importance sampling; the
                length-normalised ratio (exp of a SUM over 3,000 tokens of a 0.001 gap is 20; of the mean, 1.001)
  token_tis     w_t = min(rho_t, C)                          token TIS (Yao et al. 2025, "Your efficient RL
                framework secretly brings you off-policy RL training")
  seq_mask_geo  w_i = 1[lo_s <= exp(m_i) <= hi_s]            geometric-mean sequence mask (SkyRL, verl)
  token_mask    w_t = 1[lo_t <= rho_t <= hi_t]               IcePop's token mask (Ling team, Ring-1T, 2025)
  opsm          w_i = 0 if A_i < 0 and mean_t (log pi_rollout - log pi_theta) > delta, else 1
                off-policy sequence masking (DeepSeek-V3.2, 2025): negative-advantage sequences the current
                policy has drifted from by more than delta (a KL estimate) are left out

C = cap; [lo_s, hi_s] = seq_mask_low / high; [lo_t, hi_t] = token_mask_low / high; delta = opsm_delta, the
fields of RolloutCorrectionConfig (a run config's rl.old_policy.correction section). Every weight is a constant (no gradient) and acts on the gradient of the policy loss,
the same way under GSPO, GSPO-token and GRPO:
  - a sequence weight multiplies the sequence's objective (and its gradient);
  - a token weight scales the token's share of the gradient: the loss sees
        logp'_t = w_t logp_t + (1 - w_t) sg(logp_t)          (`apply_token_weights`)
    which equals logp_t in value, so the ratios, the clipping decisions and the reported loss are unchanged,
    while d loss / d logp_t is multiplied by w_t. Under GRPO and GSPO-token that is w_t times the token term's
    gradient (TIS as its sources write it); under GSPO it weights the token's part of d s_i (eq. 10's mean of
    token gradients becomes a weighted one).
Normalisation (1 / G, 1 / |y_i|, the global token count) is unchanged: a masked token or sequence contributes
zero, it does not shrink the denominator (TRL's choice too), so a batch's loss scale does not jump when many
are masked.

Mismatch metrics (`mismatch_metrics`, every step where the engine returned log-probs): mean |d_t|, the k3
estimate of KL(pi_rollout || pi_old) = mean (rho_t - 1 - d_t) (>= 0 per token), and the fraction of tokens with
|d_t| > ln 2 (a probability off by more than 2x); each correction adds the fraction of tokens and sequences it
masked or truncated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .metrics import masked_mean, masked_min_max_mean
from .packing import as_bool_mask, segment_ids, segment_sum
from .ratios import sequence_log_ratio

ROLLOUT_CORRECTIONS = ("none", "seq_tis", "token_tis", "seq_mask_geo", "token_mask", "opsm")
SEQUENCE_CORRECTIONS = ("seq_tis", "seq_mask_geo", "opsm")
TOKEN_CORRECTIONS = ("token_tis", "token_mask")
LN2 = math.log(2.0)
LN5 = math.log(5.0)


def normalize_correction(value) -> str:
    """A correction method's name: the booleans of earlier recipes and checkpoints map to seq_tis (true, the one
    correction there was) and none (false)."""
    if value is True:
        return "seq_tis"
    if value is False or value is None:
        return "none"
    if not isinstance(value, str) or value not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"method must be one of {', '.join(ROLLOUT_CORRECTIONS)} (true = seq_tis, "
                         f"false = none); got {value!r}")
    return value


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """The rollout correction: one method of the menu and every threshold it reads (each lives here only, so a
    recipe, the loss and the dry run's description read the same value)."""

    method: str = "none"           # none | seq_tis | token_tis | seq_mask_geo | token_mask | opsm (`true` = seq_tis)
    cap: float = 2.0               # C of seq_tis / token_tis
    seq_mask_low: float = 0.999    # seq_mask_geo keeps a sequence whose exp(mean_t log pi_old/pi_rollout) is in band
    seq_mask_high: float = 1.001
    token_mask_low: float = 0.5    # token_mask keeps tokens whose pi_old/pi_rollout is in the band (IcePop's)
    token_mask_high: float = 5.0
    opsm_delta: float = 1e-4       # opsm masks A_i < 0 sequences whose mean log pi_rollout/pi_theta exceeds this

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", normalize_correction(self.method))
        except ValueError as exc:
            raise ValueError(f"RolloutCorrectionConfig.{exc}") from None
        for name, lo in (("cap", 1.0), ("seq_mask_low", 0.0), ("seq_mask_high", 1.0),
                         ("token_mask_low", 0.0), ("token_mask_high", 1.0), ("opsm_delta", 0.0)):
            value = getattr(self, name)
            positive = lo == 0.0 and name != "opsm_delta"  # a band's lower edge of 0 would be log(0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < lo or (positive and value == 0):
                raise ValueError(f"RolloutCorrectionConfig.{name} must be a finite number "
                                 f"{'> 0' if positive else f'>= {lo:g}'}, got {value!r}")
        for low in ("seq_mask_low", "token_mask_low"):
            if getattr(self, low) > 1.0:
                raise ValueError(f"RolloutCorrectionConfig.{low} must be <= 1 (a band around ratio 1), got "
                                 f"{getattr(self, low)!r}")


def token_log_gap(old_logp_T: Tensor, rollout_logp_T: Tensor, loss_mask_T: Tensor) -> Tensor:
    """d_t = log pi_old - log pi_rollout on response tokens, 0 elsewhere (float32 or wider, detached)."""
    dtype = torch.promote_types(old_logp_T.dtype, torch.float32)
    diff_T = old_logp_T.detach().to(dtype) - rollout_logp_T.detach().to(dtype)
    return torch.where(as_bool_mask(loss_mask_T), diff_T, torch.zeros((), dtype=dtype, device=diff_T.device))


def mismatch_metrics(old_logp_T: Tensor, rollout_logp_T: Tensor, loss_mask_T: Tensor) -> dict:
    """The engine-trainer gap on response tokens, as the field reports it (docs/configuration.md, "Mismatch
    metrics"), with rho_t = exp(d_t) = pi_old / pi_rollout:
        mismatch/abs_log_ratio            mean |d_t|
        mismatch/k3_kl                    mean (rho_t - 1 - d_t): the k3 estimate of KL(pi_rollout || pi_old)
        mismatch/frac_over_ln2, _ln5      F(tau) for tau = 2, 5: the share of tokens whose probability ratio is
                                          beyond tau either way (|d_t| > ln tau; the R3 paper's F)
        mismatch/token_mult_prob_error    mean exp|d_t| (NeMo-RL's gate: 1 when the engine equals the trainer)
        mismatch/is_weight_mean, _sq_mean mean rho_t and mean rho_t^2: their ratio (mean rho)^2 / mean rho^2 is the
                                          effective sample size of the token IS weights as a fraction
                                          (mismatch/is_ess_frac, derived from the merged means)"""
    mask_T = as_bool_mask(loss_mask_T)
    d_T = token_log_gap(old_logp_T, rollout_logp_T, mask_T)
    rho_T = torch.exp(d_T)
    return {
        "mismatch/abs_log_ratio": masked_mean(d_T.abs(), mask_T),
        "mismatch/k3_kl": masked_mean(torch.expm1(d_T) - d_T, mask_T),
        "mismatch/frac_over_ln2": masked_mean((d_T.abs() > LN2).to(d_T.dtype), mask_T),
        "mismatch/frac_over_ln5": masked_mean((d_T.abs() > LN5).to(d_T.dtype), mask_T),
        "mismatch/token_mult_prob_error": masked_mean(torch.exp(d_T.abs()), mask_T),
        "mismatch/is_weight_mean": masked_mean(rho_T, mask_T),
        "mismatch/is_weight_sq_mean": masked_mean(rho_T * rho_T, mask_T),
    }


def rollout_correction_weights(
    old_logp_T: Tensor,
    rollout_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    *,
    cap: float = 2.0,
) -> tuple[Tensor, dict]:
    """rho_S = min(exp(mean log(pi_old / pi_rollout)), cap), detached; plus rollout_is/* metrics."""
    log_rho_S, lengths_S = sequence_log_ratio(old_logp_T.detach(), rollout_logp_T.detach(), loss_mask_T, cu_seqlens_S1)
    log_cap = math.log(cap)
    truncated_S = log_rho_S > log_cap
    rho_S = torch.exp(log_rho_S.clamp(max=log_cap))
    nonempty_S = lengths_S > 0
    stats = masked_min_max_mean(rho_S, nonempty_S)
    metrics = {
        "rollout_is/mean": stats["mean"],
        "rollout_is/min": stats["min"],
        "rollout_is/max": stats["max"],
        "rollout_is/truncated_frac": masked_mean(truncated_S.to(rho_S.dtype), nonempty_S),
        "rollout_is/log_ratio_mean": masked_mean(log_rho_S, nonempty_S),
    }
    return rho_S.detach(), metrics


def correction_weights(
    config: RolloutCorrectionConfig,
    *,
    logp_T: Tensor,
    old_logp_T: Tensor,
    rollout_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_S: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, dict]:
    """-> (sequence weights w_S or None, token weights w_T or None, metrics) of config.method (module docstring).
    logp_T is pi_theta's (read detached, by opsm only); advantages_S is needed by opsm."""
    c = config
    mode = c.method
    if mode == "none":
        return None, None, {}
    mask_T = as_bool_mask(loss_mask_T)
    num_seqs = cu_seqlens_S1.shape[0] - 1
    if mode in TOKEN_CORRECTIONS:
        d_T = token_log_gap(old_logp_T, rollout_logp_T, mask_T)
        if mode == "token_tis":
            log_cap = math.log(c.cap)
            affected_T = mask_T & (d_T > log_cap)
            weights_T = torch.exp(d_T.clamp(max=log_cap))
        else:
            affected_T = mask_T & ((d_T < math.log(c.token_mask_low)) | (d_T > math.log(c.token_mask_high)))
            weights_T = (~affected_T).to(d_T.dtype)
        weights_T = torch.where(mask_T, weights_T, torch.ones_like(weights_T))
        seq_id_T = segment_ids(cu_seqlens_S1, mask_T.shape[0])
        seq_affected_S = segment_sum(affected_T.to(d_T.dtype), seq_id_T, num_seqs) > 0
        nonempty_S = segment_sum(mask_T.to(d_T.dtype), seq_id_T, num_seqs) > 0
        metrics = {f"rollout_correction/{mode}/token_frac": masked_mean(affected_T.to(d_T.dtype), mask_T),
                   f"rollout_correction/{mode}/seq_frac": masked_mean(seq_affected_S.to(d_T.dtype), nonempty_S),
                   f"rollout_correction/{mode}/weight_mean": masked_mean(weights_T, mask_T)}
        return None, weights_T.detach(), metrics
    if mode == "seq_tis":  # with its earlier metric names (rollout_is/*), which the plots and reports read
        weights_S, metrics = rollout_correction_weights(old_logp_T, rollout_logp_T, mask_T, cu_seqlens_S1, cap=c.cap)
        return weights_S, None, metrics
    log_rho_S, lengths_S = sequence_log_ratio(old_logp_T.detach(), rollout_logp_T.detach(), mask_T, cu_seqlens_S1)
    nonempty_S = lengths_S > 0
    if mode == "seq_mask_geo":
        affected_S = nonempty_S & ((log_rho_S < math.log(c.seq_mask_low)) | (log_rho_S > math.log(c.seq_mask_high)))
        weights_S = (~affected_S).to(log_rho_S.dtype)
    else:  # opsm
        if advantages_S is None:
            raise ValueError("rollout_correction='opsm' needs per-sequence advantages_S")
        drift_S, _ = sequence_log_ratio(rollout_logp_T.detach(), logp_T.detach(), mask_T, cu_seqlens_S1)
        affected_S = nonempty_S & (advantages_S.detach().to(drift_S.dtype) < 0) & (drift_S > c.opsm_delta)
        weights_S = (~affected_S).to(drift_S.dtype)
    metrics = {f"rollout_correction/{mode}/seq_frac": masked_mean(affected_S.to(weights_S.dtype), nonempty_S),
               f"rollout_correction/{mode}/weight_mean": masked_mean(weights_S, nonempty_S)}
    return weights_S.detach(), None, metrics


def describe_correction(config: RolloutCorrectionConfig) -> str:
    """One line: the correction a RolloutCorrectionConfig builds, as its formula with its thresholds."""
    c = config
    formulas = {
        "none": "none",
        "seq_tis": f"seq_tis: w_i = min(exp(mean_t log pi_old/pi_rollout), {c.cap:g})",
        "token_tis": f"token_tis: w_t = min(pi_old/pi_rollout, {c.cap:g})",
        "seq_mask_geo": f"seq_mask_geo: w_i = 1[{c.seq_mask_low:g} <= exp(mean_t log pi_old/pi_rollout) <= "
                        f"{c.seq_mask_high:g}]",
        "token_mask": f"token_mask: w_t = 1[{c.token_mask_low:g} <= pi_old/pi_rollout <= {c.token_mask_high:g}]",
        "opsm": f"opsm: w_i = 0 if A_i < 0 and mean_t log pi_rollout/pi_theta > {c.opsm_delta:g}, else 1",
    }
    return formulas[c.method]


def apply_token_weights(logp_T: Tensor, weights_T: Tensor | None, loss_mask_T: Tensor) -> Tensor:
    """logp'_t = sg(logp_t) + w_t (logp_t - sg(logp_t)) on response tokens: logp_T's value bit for bit (the
    bracket is exactly 0), its gradient scaled by w_t; other positions untouched (they may hold -inf)."""
    if weights_T is None:
        return logp_T
    detached_T = logp_T.detach()
    weighted_T = detached_T + weights_T.detach().to(logp_T.dtype) * (logp_T - detached_T)
    return torch.where(as_bool_mask(loss_mask_T), weighted_T, logp_T)
