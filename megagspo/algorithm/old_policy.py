"""Where pi_old comes from (paper §5.4), and the optional rollout -> recomputed importance correction.

Legend (docs/architecture.md): T packed tokens, N packed sequences, written `_S` in names here (`_S1`: the
N + 1 offsets).

source = "recompute": pi_old is the training engine's recomputation (`old_logp_T`), the usual practice.
source = "rollout":   pi_old is the inference engine's log-probs (`rollout_logp_T`): GSPO depends only on
                      the length-normalised sequence likelihood, which tolerates the train/inference
                      precision gap, so the recompute pass can be skipped (§5.4).

With "recompute", `rollout_correction=True` adds a sequence-level importance weight for the gap between
the sampling (rollout) policy and the recomputed pi_old:
    rho_i = min(exp(mean_t[log pi_old - log pi_rollout]), cap)
It is the length-normalised ratio, like s_i in eq. 8. NeMo-RL used exp(SUM) over tokens and
down-weighted whole batches ~17x (NVIDIA-NeMo/RL PR #2269): a per-token gap of 0.001 over 3,000 tokens is
exp(3) = 20 with the sum but 1.001 with the mean. The weight is a constant (no gradient), truncated at
`cap` in the log domain so it can never overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .metrics import masked_mean, masked_min_max_mean
from .packing import PackedBatch
from .ratios import sequence_log_ratio
from .validation import check_same_shape, require_choice

OLD_LOGP_SOURCES = ("recompute", "rollout")


@dataclass(frozen=True)
class OldPolicyConfig:
    source: str = "recompute"
    rollout_correction: bool = False
    correction_cap: float = 2.0

    def __post_init__(self) -> None:
        require_choice("OldPolicyConfig", "source", self.source, OLD_LOGP_SOURCES)
        cap = self.correction_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 1.0:
            raise ValueError(f"OldPolicyConfig.correction_cap must be a finite number >= 1, got {cap!r}")
        if self.rollout_correction and self.source == "rollout":
            raise ValueError(
                "OldPolicyConfig.rollout_correction=True needs source='recompute': with source='rollout' "
                "pi_old IS the rollout policy and there is nothing to correct"
            )


def rollout_correction_weights(
    old_logp_T: Tensor,
    rollout_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    *,
    cap: float = 2.0,
) -> tuple[Tensor, dict]:
    """rho_S = min(exp(mean log(pi_old / pi_rollout)), cap), detached; plus rollout_is/* metrics."""
    log_rho_S, lengths_S = sequence_log_ratio(old_logp_T.detach(), rollout_logp_T, loss_mask_T, cu_seqlens_S1)
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


def resolve_old_logp(batch: PackedBatch, config: OldPolicyConfig) -> tuple[Tensor, Optional[Tensor], dict]:
    """-> (old_logp_T to use as pi_old, per-sequence weights or None, metrics)."""
    if config.source == "rollout":
        if batch.rollout_logp_T is None:
            raise ValueError("OldPolicyConfig.source='rollout' but the batch has no rollout_logp_T")
        return batch.rollout_logp_T, None, {}
    if batch.old_logp_T is None:
        raise ValueError(
            "OldPolicyConfig.source='recompute' but the batch has no old_logp_T; recompute it or use "
            "source='rollout' to take the rollout engine's log-probs (§5.4)"
        )
    if not config.rollout_correction:
        return batch.old_logp_T, None, {}
    if batch.rollout_logp_T is None:
        raise ValueError("OldPolicyConfig.rollout_correction=True but the batch has no rollout_logp_T")
    check_same_shape("old_logp_T", batch.old_logp_T, rollout_logp_T=batch.rollout_logp_T)
    weights_S, metrics = rollout_correction_weights(
        batch.old_logp_T, batch.rollout_logp_T, batch.loss_mask_T, batch.cu_seqlens_S1, cap=config.correction_cap
    )
    return batch.old_logp_T, weights_S, metrics
