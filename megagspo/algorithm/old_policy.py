"""Where pi_old comes from (paper §5.4), and the optional rollout -> recomputed importance correction.

Legend (docs/architecture.md): T packed tokens, N packed sequences, written `_S` in names here (`_S1`: the
N + 1 offsets).

source = "recompute": pi_old is the training engine's recomputation (`old_logp_T`), the usual practice.
source = "rollout":   pi_old is the inference engine's log-probs (`rollout_logp_T`): GSPO depends only on
                      the length-normalised sequence likelihood, which tolerates the train/inference
                      precision gap, so the recompute pass can be skipped (§5.4).

With "recompute", `correction` (RolloutCorrectionConfig) picks how the loss corrects for the gap between the sampling (rollout)
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

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from .packing import PackedBatch
from .rollout_correction import RolloutCorrectionConfig, correction_weights, mismatch_metrics
from .validation import check_same_shape, require_choice

OLD_LOGP_SOURCES = ("recompute", "rollout")


@dataclass(frozen=True)
class OldPolicyConfig:
    """Where pi_old comes from (§5.4) and, when it is recomputed, the rollout correction."""

    source: str = "recompute"      # recompute (a no-grad forward of the trainer) | rollout (the engine's, §5.4)
    # with source = recompute: what the loss does about the rollout -> recomputed gap
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        require_choice("OldPolicyConfig", "source", self.source, OLD_LOGP_SOURCES)
        if isinstance(self.correction, dict):
            object.__setattr__(self, "correction", RolloutCorrectionConfig(**self.correction))
        elif not isinstance(self.correction, RolloutCorrectionConfig):
            raise TypeError(f"OldPolicyConfig.correction must be a RolloutCorrectionConfig or a mapping, got "
                            f"{self.correction!r}")
        if self.correction.method != "none" and self.source == "rollout":
            raise ValueError(
                f"OldPolicyConfig.correction.method={self.correction.method!r} needs source='recompute': with "
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
        if config.correction.method != "none":
            raise ValueError(f"OldPolicyConfig.correction.method={config.correction.method!r} but the batch has "
                             "no rollout_logp_T")
        return batch.old_logp_T, None, None, {}
    check_same_shape("old_logp_T", batch.old_logp_T, rollout_logp_T=batch.rollout_logp_T)
    metrics = mismatch_metrics(batch.old_logp_T, batch.rollout_logp_T, batch.loss_mask_T)
    weights_S, weights_T, correction_metrics = correction_weights(
        config.correction, logp_T=batch.logp_T, old_logp_T=batch.old_logp_T,
        rollout_logp_T=batch.rollout_logp_T, loss_mask_T=batch.loss_mask_T, cu_seqlens_S1=batch.cu_seqlens_S1,
        advantages_S=batch.advantages_S)
    return batch.old_logp_T, weights_S, weights_T, {**metrics, **correction_metrics}
