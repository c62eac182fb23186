"""GSPO algorithm core: pure tensor code, no model.

Group advantages (eq. 7), sequence and token importance ratios on packed sequences (eqs. 3, 8), the
GSPO / GSPO-token / GRPO losses (eqs. 6, 14-15, 2) in a registry, optional KL penalty, pi_old from the
rollout engine with a sequence-level importance correction (§5.4), and tensor-valued metrics.
"""

from .advantages import GroupAdvantageConfig, group_advantages
from .kl import KL_ESTIMATORS, KLConfig, token_kl
from .losses import (
    GRPO_AGGREGATIONS,
    GRPOConfig,
    GSPOConfig,
    GSPOTokenConfig,
    grpo_loss,
    gspo_sequence_loss,
    gspo_token_loss,
    kl_penalty,
)
from .metrics import merge_metrics
from .old_policy import OLD_LOGP_SOURCES, OldPolicyConfig, resolve_old_logp
from .rollout_correction import RolloutCorrectionConfig, rollout_correction_weights
from .packing import (
    PackedBatch,
    broadcast_to_tokens,
    packed_to_padded,
    padded_to_packed,
    segment_ids,
    segment_sum,
)
from .ratios import response_lengths, sequence_log_ratio, sequence_ratio, token_log_ratio
from .registry import available_losses, get_loss, make_loss_config, register_loss

__all__ = [
    "GRPO_AGGREGATIONS",
    "GRPOConfig",
    "GSPOConfig",
    "GSPOTokenConfig",
    "GroupAdvantageConfig",
    "KLConfig",
    "KL_ESTIMATORS",
    "OLD_LOGP_SOURCES",
    "OldPolicyConfig",
    "PackedBatch",
    "available_losses",
    "broadcast_to_tokens",
    "get_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_sequence_loss",
    "gspo_token_loss",
    "kl_penalty",
    "make_loss_config",
    "merge_metrics",
    "packed_to_padded",
    "padded_to_packed",
    "register_loss",
    "resolve_old_logp",
    "response_lengths",
    "RolloutCorrectionConfig",
    "rollout_correction_weights",
    "segment_ids",
    "segment_sum",
    "sequence_log_ratio",
    "sequence_ratio",
    "token_kl",
    "token_log_ratio",
]
