"""Where pi_old comes from (paper §5.4), and the optional rollout -> recomputed importance correction.

Legend (docs/architecture.md): T packed tokens, N packed sequences, written `_S` in names here (`_S1`: the
N + 1 offsets).

source = "recompute": pi_old is the training engine's recomputation (`old_logp_T`), the usual practice.
source = "rollout":   pi_old is the inference engine's log-probs (`rollout_logp_T`): GSPO depends only on
                      the length-normalised sequence likelihood, which tolerates the train/inference
                      precision gap, so the recompute pass can be skipped (§5.4).

With "recompute", `rollout_correction` picks how the loss corrects for the gap between the sampling (rollout)
policy and the recomputed pi_old (megagspo.algorithm.rollout_correction: none | seq_tis | token_tis |
seq_mask_geo | token_mask | opsm), and the mismatch metrics of that gap are reported whenever the batch carries
the engine's log-probs. seq_tis (`true` in earlier recipes) is
    rho_i = min(exp(mean_t[log pi_old - log pi_rollout]), cap)
the length-normalised ratio, like s_i in eq. 8. NeMo-RL used exp(SUM) over tokens and down-weighted whole
batches ~17x (NVIDIA-NeMo/RL PR #2269): a per-token gap of 0.001 over 3,000 tokens is exp(3) = 20 with the sum
but 1.001 with the mean. Every weight is a constant (no gradient), truncated in the log domain where it is
capped so it can never overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from .packing import PackedBatch
from .rollout_correction import correction_weights, mismatch_metrics, normalize_correction
from .validation import check_same_shape, require_choice

OLD_LOGP_SOURCES = ("recompute", "rollout")


@dataclass(frozen=True)
class OldPolicyConfig:
    source: str = "recompute"
    rollout_correction: str = "none"  # megagspo.algorithm.rollout_correction.ROLLOUT_CORRECTIONS
    correction_cap: float = 2.0       # C of seq_tis / token_tis
    seq_mask_low: float = 0.999       # seq_mask_geo keeps a sequence when exp(mean_t d_t) is in [low, high]
    seq_mask_high: float = 1.001
    token_mask_low: float = 0.5       # token_mask keeps a token when exp(d_t) is in [low, high] (IcePop's band)
    token_mask_high: float = 5.0
    opsm_delta: float = 1e-4          # opsm: the drift (mean log pi_rollout / pi_theta) a negative sequence may have

    def __post_init__(self) -> None:
        require_choice("OldPolicyConfig", "source", self.source, OLD_LOGP_SOURCES)
        try:
            object.__setattr__(self, "rollout_correction", normalize_correction(self.rollout_correction))
        except ValueError as exc:
            raise ValueError(f"OldPolicyConfig.{exc}") from None
        for name, lo in (("correction_cap", 1.0), ("seq_mask_low", 0.0), ("seq_mask_high", 1.0),
                         ("token_mask_low", 0.0), ("token_mask_high", 1.0), ("opsm_delta", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < lo or (lo == 0.0 and name != "opsm_delta" and value == 0):
                raise ValueError(f"OldPolicyConfig.{name} must be a finite number "
                                 f"{'> 0' if lo == 0.0 and name != 'opsm_delta' else f'>= {lo:g}'}, got {value!r}")
        for low, high in (("seq_mask_low", "seq_mask_high"), ("token_mask_low", "token_mask_high")):
            if getattr(self, low) > 1.0:
                raise ValueError(f"OldPolicyConfig.{low} must be <= 1 (a band around ratio 1), got "
                                 f"{getattr(self, low)!r}")
        if self.rollout_correction != "none" and self.source == "rollout":
            raise ValueError(
                f"OldPolicyConfig.rollout_correction={self.rollout_correction!r} needs source='recompute': with "
                "source='rollout' pi_old IS the rollout policy and there is nothing to correct"
            )


def resolve_old_logp(batch: PackedBatch, config: OldPolicyConfig
                     ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], dict]:
    """-> (old_logp_T to use as pi_old, per-sequence weights or None, per-token weights or None, metrics).
    The mismatch metrics are reported whenever pi_old is recomputed and the batch has the engine's log-probs."""
    if config.source == "rollout":
        if batch.rollout_logp_T is None:
            raise ValueError("OldPolicyConfig.source='rollout' but the batch has no rollout_logp_T")
        return batch.rollout_logp_T, None, None, {}
    if batch.old_logp_T is None:
        raise ValueError(
            "OldPolicyConfig.source='recompute' but the batch has no old_logp_T; recompute it or use "
            "source='rollout' to take the rollout engine's log-probs (§5.4)"
        )
    if batch.rollout_logp_T is None:
        if config.rollout_correction != "none":
            raise ValueError(f"OldPolicyConfig.rollout_correction={config.rollout_correction!r} but the batch has "
                             "no rollout_logp_T")
        return batch.old_logp_T, None, None, {}
    check_same_shape("old_logp_T", batch.old_logp_T, rollout_logp_T=batch.rollout_logp_T)
    metrics = mismatch_metrics(batch.old_logp_T, batch.rollout_logp_T, batch.loss_mask_T)
    weights_S, weights_T, correction_metrics = correction_weights(
        config.rollout_correction, logp_T=batch.logp_T, old_logp_T=batch.old_logp_T,
        rollout_logp_T=batch.rollout_logp_T, loss_mask_T=batch.loss_mask_T, cu_seqlens_S1=batch.cu_seqlens_S1,
        advantages_S=batch.advantages_S, cap=config.correction_cap, seq_mask_low=config.seq_mask_low,
        seq_mask_high=config.seq_mask_high, token_mask_low=config.token_mask_low,
        token_mask_high=config.token_mask_high, opsm_delta=config.opsm_delta)
    return batch.old_logp_T, weights_S, weights_T, {**metrics, **correction_metrics}
