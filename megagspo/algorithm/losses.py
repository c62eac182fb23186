"""Policy losses on packed sequences: GSPO (eq. 6), GSPO-token (eqs. 14-15), GRPO (eq. 2), plus an
optional KL penalty; functional forms and their registered `(batch, config)` entry points.

Legend (docs/architecture.md): T = packed tokens; packed sequences are spelled `_S` in names here (`_S1` =
their count + 1 offsets, `cu_seqlens_S1`); N = sequences in the GLOBAL batch (`num_global_sequences`), N_tok =
response tokens in the global batch.

Normalisation: every loss divides by a global count (N or N_tok), never by a local one, so the sum of
micro-batch losses and their gradients equal the global batch's however it is split across
micro-batches, accumulation steps and data-parallel ranks (which must SUM gradients).

Clipping as code: min(r*A, clip(r)*A) picks the clipped branch exactly when
    (A > 0 and r > 1 + clip_high) or (A < 0 and r < 1 - clip_low)
and that branch is a constant. We evaluate exp() of the live log-ratio only where the branch is live
(clipped, A = 0 and masked terms get exp(0)), so the backward never forms 0 * exp(big) = NaN; the value of a clipped term is
clip(r)*A computed from the detached ratio. Fully masked sequences contribute exactly 0.
No .item() or value-dependent Python branching below the `validate` block: metrics stay tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import Tensor

from .kl import KLConfig, token_kl
from .metrics import clip_metrics, masked_mean
from .old_policy import OldPolicyConfig, resolve_old_logp
from .rollout_correction import apply_token_weights
from .packing import Count, PackedBatch, as_bool_mask, compute_dtype, segment_ids, segment_sum
from .ratios import masked_segment_mean, token_log_ratio
from .registry import register_loss
from .validation import (
    check_1d,
    check_cu_seqlens,
    check_finite,
    check_float,
    check_mask,
    check_num_global,
    check_same_shape,
    require_choice,
    require_positive_finite,
)

GRPO_AGGREGATIONS = ("seq_mean_token_mean", "token_mean")


# ----------------------------------------------------------------------------------------------- checks


def _validate(
    *,
    logp_T: Tensor,
    old_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_S: Optional[Tensor] = None,
    advantages_T: Optional[Tensor] = None,
    num_global_sequences: Optional[Count] = None,
    num_global_tokens: Optional[Count] = None,
    seq_weights_S: Optional[Tensor] = None,
    **extra_T: Optional[Tensor],
) -> None:
    check_1d("logp_T", logp_T)
    check_float("logp_T", logp_T)
    check_same_shape("logp_T", logp_T, old_logp_T=old_logp_T, loss_mask_T=loss_mask_T, advantages_T=advantages_T,
                     **extra_T)
    check_float("old_logp_T", old_logp_T)
    check_mask("loss_mask_T", loss_mask_T)
    num_tokens = logp_T.shape[0]
    num_seqs = None
    if advantages_S is not None:
        check_1d("advantages_S", advantages_S)
        check_float("advantages_S", advantages_S)
        num_seqs = advantages_S.shape[0]
    check_cu_seqlens(cu_seqlens_S1, num_tokens, num_seqs)
    num_seqs = cu_seqlens_S1.shape[0] - 1
    if seq_weights_S is not None:
        check_1d("seq_weights_S", seq_weights_S)
        if seq_weights_S.shape[0] != num_seqs:
            raise ValueError(f"seq_weights_S has shape {tuple(seq_weights_S.shape)} but there are {num_seqs} sequences")
        check_finite("seq_weights_S", seq_weights_S)
    mask_T = as_bool_mask(loss_mask_T)
    check_finite("logp_T", logp_T, mask_T)
    check_finite("old_logp_T", old_logp_T, mask_T)
    for name, x in extra_T.items():
        if x is not None:
            check_finite(name, x, mask_T)
    if advantages_S is not None:
        check_finite("advantages_S", advantages_S)
    if advantages_T is not None:
        check_float("advantages_T", advantages_T)
        check_finite("advantages_T", advantages_T, mask_T)
    if num_global_sequences is not None:
        check_num_global("num_global_sequences", num_global_sequences, num_seqs)
    if num_global_tokens is not None:
        check_num_global("num_global_tokens", num_global_tokens, int(mask_T.sum()))


def _check_clip(owner: str, clip_low: float, clip_high: float) -> None:
    require_positive_finite(owner, "clip_low", clip_low)
    require_positive_finite(owner, "clip_high", clip_high)
    if clip_low >= 1.0:
        raise ValueError(f"{owner}.clip_low must be < 1 (the lower bound 1 - clip_low must stay > 0), got {clip_low!r}")


# -------------------------------------------------------------------------------------------- functional


def gspo_sequence_loss(
    logp_T: Tensor,
    old_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_S: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_global_sequences: Count,
    seq_weights_S: Optional[Tensor] = None,
    entropy_T: Optional[Tensor] = None,
    validate: bool = True,
) -> tuple[Tensor, dict]:
    """GSPO (eq. 6): loss = -(1/N) * sum_i w_i * min(s_i A_i, clip(s_i, 1-clip_low, 1+clip_high) A_i).

    s_i = exp(m_i), m_i = sum_t mask (logp - old_logp) / max(|y_i|, 1)  (eq. 8).
    d loss / d logp_t = -(1/N) w_i A_i s_i / |y_i| * [not clipped]  (eq. 11) for response token t of i.
    `seq_weights_S` (constant per-sequence weights, e.g. the rollout correction) defaults to 1.
    """
    if validate:
        _check_clip("gspo_sequence_loss", clip_low, clip_high)
        _validate(logp_T=logp_T, old_logp_T=old_logp_T, loss_mask_T=loss_mask_T, cu_seqlens_S1=cu_seqlens_S1,
                  advantages_S=advantages_S, num_global_sequences=num_global_sequences, seq_weights_S=seq_weights_S,
                  entropy_T=entropy_T)
    dtype = compute_dtype(logp_T)
    mask_T = as_bool_mask(loss_mask_T)
    seq_id_T = segment_ids(cu_seqlens_S1, logp_T.shape[0])
    log_ratio_T = token_log_ratio(logp_T, old_logp_T, mask_T)
    log_ratio_S, lengths_S = masked_segment_mean(log_ratio_T, mask_T, seq_id_T, cu_seqlens_S1.shape[0] - 1)  # eq. 8
    adv_S = advantages_S.detach().to(dtype)
    nonempty_S = lengths_S > 0
    ratio_S = torch.exp(log_ratio_S.detach())

    # eq. 6: the min() takes the clipped (constant) branch on these sides only.
    clip_high_S = nonempty_S & (adv_S > 0) & (ratio_S > 1.0 + clip_high)
    clip_low_S = nonempty_S & (adv_S < 0) & (ratio_S < 1.0 - clip_low)
    live_S = nonempty_S & (adv_S != 0) & ~(clip_high_S | clip_low_S)
    zero = torch.zeros((), dtype=dtype, device=logp_T.device)
    live_ratio_S = torch.exp(torch.where(live_S, log_ratio_S, zero))
    clipped_value_S = ratio_S.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_S
    objective_S = torch.where(live_S, live_ratio_S * adv_S, torch.where(nonempty_S, clipped_value_S, zero))
    if seq_weights_S is not None:
        objective_S = objective_S * seq_weights_S.detach().to(dtype)
    loss = _per_count(-objective_S.sum(), num_global_sequences)

    metrics = clip_metrics(
        ratio_X=ratio_S, valid_X=nonempty_S,
        clip_low_tok=mask_T & clip_low_S[seq_id_T], clip_high_tok=mask_T & clip_high_S[seq_id_T],
        clip_low_seq=clip_low_S, clip_high_seq=clip_high_S,
        mask_T=mask_T, lengths_S=lengths_S, log_ratio_T=log_ratio_T, entropy_T=entropy_T,
    )
    metrics["loss/policy"] = loss.detach()
    return loss, metrics


def gspo_token_loss(
    logp_T: Tensor,
    old_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_T: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_global_sequences: Count,
    seq_weights_S: Optional[Tensor] = None,
    entropy_T: Optional[Tensor] = None,
    validate: bool = True,
) -> tuple[Tensor, dict]:
    """GSPO-token (eq. 14): loss = -(1/N) sum_i w_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it),
    s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]  (eq. 15), whose value is s_i and whose gradient wrt logp_t is
    s_i (eq. 17). With A_it = A_i it equals GSPO in value, clipping and gradient (after eq. 18).
    """
    if validate:
        _check_clip("gspo_token_loss", clip_low, clip_high)
        _validate(logp_T=logp_T, old_logp_T=old_logp_T, loss_mask_T=loss_mask_T, cu_seqlens_S1=cu_seqlens_S1,
                  advantages_T=advantages_T, num_global_sequences=num_global_sequences, seq_weights_S=seq_weights_S,
                  entropy_T=entropy_T)
    dtype = compute_dtype(logp_T)
    mask_T = as_bool_mask(loss_mask_T)
    num_seqs = cu_seqlens_S1.shape[0] - 1
    seq_id_T = segment_ids(cu_seqlens_S1, logp_T.shape[0])
    log_ratio_T = token_log_ratio(logp_T, old_logp_T, mask_T)
    log_ratio_S, lengths_S = masked_segment_mean(log_ratio_T, mask_T, seq_id_T, num_seqs)  # eq. 8
    sg_log_ratio_T = log_ratio_S.detach()[seq_id_T]
    ratio_T = torch.exp(sg_log_ratio_T)  # value of s_it = s_i
    adv_T = advantages_T.detach().to(dtype)

    clip_high_T = mask_T & (adv_T > 0) & (ratio_T > 1.0 + clip_high)
    clip_low_T = mask_T & (adv_T < 0) & (ratio_T < 1.0 - clip_low)
    live_T = mask_T & (adv_T != 0) & ~(clip_high_T | clip_low_T)
    zero = torch.zeros((), dtype=dtype, device=logp_T.device)
    logp_c_T = logp_T.to(dtype)
    # eq. 15 in logs: log s_it = sg[log s_i] + log pi(y_t) - sg[log pi(y_t)].
    live_ratio_T = torch.exp(torch.where(live_T, sg_log_ratio_T + (logp_c_T - logp_c_T.detach()), zero))
    clipped_value_T = ratio_T.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_T
    objective_T = torch.where(live_T, live_ratio_T * adv_T, torch.where(mask_T, clipped_value_T, zero))
    objective_S, _ = masked_segment_mean(objective_T, mask_T, seq_id_T, num_seqs)  # eq. 14 token mean
    if seq_weights_S is not None:
        objective_S = objective_S * seq_weights_S.detach().to(dtype)
    loss = _per_count(-objective_S.sum(), num_global_sequences)

    clipped_S_low = segment_sum(clip_low_T.to(dtype), seq_id_T, num_seqs) > 0
    clipped_S_high = segment_sum(clip_high_T.to(dtype), seq_id_T, num_seqs) > 0
    metrics = clip_metrics(
        ratio_X=torch.exp(log_ratio_S.detach()), valid_X=lengths_S > 0,
        clip_low_tok=clip_low_T, clip_high_tok=clip_high_T, clip_low_seq=clipped_S_low, clip_high_seq=clipped_S_high,
        mask_T=mask_T, lengths_S=lengths_S, log_ratio_T=log_ratio_T, entropy_T=entropy_T,
    )
    metrics["loss/policy"] = loss.detach()
    return loss, metrics


def grpo_loss(
    logp_T: Tensor,
    old_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    advantages_T: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.27,
    dual_clip: Optional[float] = None,
    aggregation: str = "seq_mean_token_mean",
    num_global_sequences: Optional[Count] = None,
    num_global_tokens: Optional[Count] = None,
    seq_weights_S: Optional[Tensor] = None,
    entropy_T: Optional[Tensor] = None,
    validate: bool = True,
) -> tuple[Tensor, dict]:
    """GRPO (eq. 2) with token ratios w_t = exp(logp - old_logp) (eq. 3) and decoupled clip ranges.

    objective_t = min(w_t A_t, clip(w_t, 1-clip_low, 1+clip_high) A_t), and with `dual_clip` = c > 1,
    for A_t < 0 it is further bounded below by c * A_t (dual clip: a huge w on a negative advantage).
    aggregation "seq_mean_token_mean" (eq. 2): -(1/N) sum_i w_i (1/|y_i|) sum_t objective_t;
    aggregation "token_mean":                  -(1/N_tok) sum_i w_i sum_t objective_t.
    Gradient (eq. 13, seq mean): d loss / d logp_t = -(1/N) w_i A_t w_t / |y_i| * [not clipped].
    """
    if validate:
        _check_clip("grpo_loss", clip_low, clip_high)
        _check_dual_clip("grpo_loss", dual_clip)
        require_choice("grpo_loss", "aggregation", aggregation, GRPO_AGGREGATIONS)
        _validate(logp_T=logp_T, old_logp_T=old_logp_T, loss_mask_T=loss_mask_T, cu_seqlens_S1=cu_seqlens_S1,
                  advantages_T=advantages_T, num_global_sequences=num_global_sequences,
                  num_global_tokens=num_global_tokens, seq_weights_S=seq_weights_S, entropy_T=entropy_T)
    _require_normaliser(aggregation, num_global_sequences, num_global_tokens)
    dtype = compute_dtype(logp_T)
    mask_T = as_bool_mask(loss_mask_T)
    num_seqs = cu_seqlens_S1.shape[0] - 1
    seq_id_T = segment_ids(cu_seqlens_S1, logp_T.shape[0])
    log_ratio_T = token_log_ratio(logp_T, old_logp_T, mask_T)  # eq. 3 in logs
    ratio_T = torch.exp(log_ratio_T.detach())
    adv_T = advantages_T.detach().to(dtype)

    clip_high_T = mask_T & (adv_T > 0) & (ratio_T > 1.0 + clip_high)
    clip_low_T = mask_T & (adv_T < 0) & (ratio_T < 1.0 - clip_low)
    zero = torch.zeros((), dtype=dtype, device=logp_T.device)
    clipped_value_T = ratio_T.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_T
    if dual_clip is not None:
        dual_T = mask_T & (adv_T < 0) & (ratio_T > dual_clip)
        clipped_value_T = torch.where(dual_T, dual_clip * adv_T, clipped_value_T)
        clip_high_T = clip_high_T | dual_T  # dual clip bounds the high side of the ratio
    live_T = mask_T & (adv_T != 0) & ~(clip_high_T | clip_low_T)
    live_ratio_T = torch.exp(torch.where(live_T, log_ratio_T, zero))
    objective_T = torch.where(live_T, live_ratio_T * adv_T, torch.where(mask_T, clipped_value_T, zero))

    if seq_weights_S is not None:
        objective_T = objective_T * seq_weights_S.detach().to(dtype)[seq_id_T]
    objective_S, lengths_S = masked_segment_mean(objective_T, mask_T, seq_id_T, num_seqs)
    if aggregation == "seq_mean_token_mean":
        loss = _per_count(-objective_S.sum(), num_global_sequences)
    else:
        loss = _per_count(-objective_T.sum(), num_global_tokens)

    metrics = clip_metrics(
        ratio_X=ratio_T, valid_X=mask_T,
        clip_low_tok=clip_low_T, clip_high_tok=clip_high_T,
        clip_low_seq=segment_sum(clip_low_T.to(dtype), seq_id_T, num_seqs) > 0,
        clip_high_seq=segment_sum(clip_high_T.to(dtype), seq_id_T, num_seqs) > 0,
        mask_T=mask_T, lengths_S=lengths_S, log_ratio_T=log_ratio_T, entropy_T=entropy_T,
    )
    metrics["loss/policy"] = loss.detach()
    return loss, metrics


def _per_count(total: Tensor, count: Count) -> Tensor:
    """Divide by a global count kept in the loss's dtype (a float64 count tensor would upcast the loss)."""
    return total / (count.to(total.dtype) if isinstance(count, Tensor) else count)


def _check_dual_clip(owner: str, dual_clip) -> None:
    if dual_clip is None:
        return
    require_positive_finite(owner, "dual_clip", dual_clip)
    if dual_clip <= 1.0:
        raise ValueError(f"{owner}.dual_clip must be None or > 1 (a bound on the ratio for A < 0), got {dual_clip!r}")


def _require_normaliser(aggregation: str, num_global_sequences, num_global_tokens) -> None:
    if aggregation == "seq_mean_token_mean" and num_global_sequences is None:
        raise ValueError("GRPO aggregation 'seq_mean_token_mean' needs num_global_sequences")
    if aggregation == "token_mean" and num_global_tokens is None:
        raise ValueError("GRPO aggregation 'token_mean' needs num_global_tokens (response tokens, global batch)")


def kl_penalty(
    logp_T: Tensor,
    ref_logp_T: Tensor,
    loss_mask_T: Tensor,
    cu_seqlens_S1: Tensor,
    *,
    estimator: str = "k3",
    aggregation: str = "seq_mean_token_mean",
    num_global_sequences: Optional[Count] = None,
    num_global_tokens: Optional[Count] = None,
) -> tuple[Tensor, Tensor]:
    """KL(pi_theta || pi_ref) aggregated like the policy loss it is added to -> (penalty, token mean)."""
    _require_normaliser(aggregation, num_global_sequences, num_global_tokens)
    kl_T = token_kl(logp_T, ref_logp_T, loss_mask_T, estimator)
    mask_T = as_bool_mask(loss_mask_T)
    if aggregation == "token_mean":
        penalty = _per_count(kl_T.sum(), num_global_tokens)
    else:
        seq_id_T = segment_ids(cu_seqlens_S1, logp_T.shape[0])
        kl_S, _ = masked_segment_mean(kl_T, mask_T, seq_id_T, cu_seqlens_S1.shape[0] - 1)
        penalty = _per_count(kl_S.sum(), num_global_sequences)
    return penalty, masked_mean(kl_T.detach(), mask_T)


# ------------------------------------------------------------------------------------- configs, registry


def _coerce(self, name: str, cls: type) -> None:
    value = getattr(self, name)
    if isinstance(value, dict):
        object.__setattr__(self, name, cls(**value))
    elif not isinstance(value, cls):
        raise TypeError(f"{type(self).__name__}.{name} must be a {cls.__name__} or a mapping, got {value!r}")


@dataclass(frozen=True)
class GSPOConfig:
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    kl: KLConfig = field(default_factory=KLConfig)
    old_policy: OldPolicyConfig = field(default_factory=OldPolicyConfig)
    validate: bool = True

    def __post_init__(self) -> None:
        _check_clip(type(self).__name__, self.clip_low, self.clip_high)
        _coerce(self, "kl", KLConfig)
        _coerce(self, "old_policy", OldPolicyConfig)


@dataclass(frozen=True)
class GSPOTokenConfig(GSPOConfig):
    pass


@dataclass(frozen=True)
class GRPOConfig:
    clip_low: float = 0.2
    clip_high: float = 0.27
    dual_clip: Optional[float] = None
    aggregation: str = "seq_mean_token_mean"
    kl: KLConfig = field(default_factory=KLConfig)
    old_policy: OldPolicyConfig = field(default_factory=OldPolicyConfig)
    validate: bool = True

    def __post_init__(self) -> None:
        _check_clip("GRPOConfig", self.clip_low, self.clip_high)
        _check_dual_clip("GRPOConfig", self.dual_clip)
        require_choice("GRPOConfig", "aggregation", self.aggregation, GRPO_AGGREGATIONS)
        _coerce(self, "kl", KLConfig)
        _coerce(self, "old_policy", OldPolicyConfig)


# The Config of a built-in loss (megagspo.algorithm.registry.build_loss_config builds the one rl.loss.name names)
LossConfig = Union[GSPOConfig, GSPOTokenConfig, GRPOConfig]


def _token_advantages(batch: PackedBatch) -> Tensor:
    if batch.advantages_T is not None:
        return batch.advantages_T
    if batch.advantages_S is None:
        raise ValueError("the batch has neither advantages_T nor advantages_S")
    if batch.advantages_S.dim() != 1 or batch.advantages_S.shape[0] != batch.num_sequences:
        raise ValueError(
            f"advantages_S has shape {tuple(batch.advantages_S.shape)} but cu_seqlens_S1 describes "
            f"{batch.num_sequences} sequences"
        )
    return batch.advantages_S[segment_ids(batch.cu_seqlens_S1, batch.num_tokens)]


def finish_loss(batch: PackedBatch, config, policy_loss: Tensor, metrics: dict, extra: dict,
                aggregation: str = "seq_mean_token_mean") -> tuple[Tensor, dict]:
    """The registered losses' common epilogue: + kl_coef x the KL penalty aggregated like the policy loss
    (when config.kl is on), the old-policy metrics `extra`, and the total as metrics["loss"]. Shared by the
    torch losses here and the fused kernel entry points (megagspo.kernels.policy_losses)."""
    loss = policy_loss
    if config.kl.enabled:
        if batch.ref_logp_T is None:
            raise ValueError(f"KLConfig.coef={config.kl.coef} > 0 but the batch has no ref_logp_T")
        if config.validate:
            check_same_shape("logp_T", batch.logp_T, ref_logp_T=batch.ref_logp_T)
            check_finite("ref_logp_T", batch.ref_logp_T, as_bool_mask(batch.loss_mask_T))
        penalty, kl_mean = kl_penalty(
            batch.logp_T, batch.ref_logp_T, batch.loss_mask_T, batch.cu_seqlens_S1,
            estimator=config.kl.estimator, aggregation=aggregation,
            num_global_sequences=batch.num_global_sequences, num_global_tokens=batch.num_global_tokens,
        )
        loss = loss + config.kl.coef * penalty
        metrics["loss/kl"] = (config.kl.coef * penalty).detach()
        metrics["kl/ref"] = kl_mean
    metrics.update(extra)
    metrics["loss"] = loss.detach()
    return loss, metrics


def _old_logp(batch: PackedBatch, config) -> tuple[Tensor, Tensor, Optional[Tensor], dict]:
    """-> (logp_T with the rollout correction's token weights on its gradient, old_logp_T, sequence weights
    or None, metrics)."""
    if config.validate and config.old_policy.source == "recompute" and batch.rollout_logp_T is not None:
        check_same_shape("logp_T", batch.logp_T, rollout_logp_T=batch.rollout_logp_T)
        check_finite("rollout_logp_T", batch.rollout_logp_T, as_bool_mask(batch.loss_mask_T))
    old_logp_T, weights_S, weights_T, extra = resolve_old_logp(batch, config.old_policy)
    return apply_token_weights(batch.logp_T, weights_T, batch.loss_mask_T), old_logp_T, weights_S, extra


@register_loss("gspo", GSPOConfig)
def gspo(batch: PackedBatch, config: GSPOConfig) -> tuple[Tensor, dict]:
    """GSPO (eq. 6) on a PackedBatch; needs advantages_S."""
    if batch.advantages_S is None:
        raise ValueError("loss 'gspo' needs per-sequence advantages_S (use 'gspo_token' for per-token advantages)")
    logp_T, old_logp_T, weights_S, extra = _old_logp(batch, config)
    loss, metrics = gspo_sequence_loss(
        logp_T, old_logp_T, batch.loss_mask_T, batch.cu_seqlens_S1, batch.advantages_S,
        clip_low=config.clip_low, clip_high=config.clip_high, num_global_sequences=batch.num_global_sequences,
        seq_weights_S=weights_S, entropy_T=batch.entropy_T, validate=config.validate,
    )
    return finish_loss(batch, config, loss, metrics, extra)


@register_loss("gspo_token", GSPOTokenConfig)
def gspo_token(batch: PackedBatch, config: GSPOTokenConfig) -> tuple[Tensor, dict]:
    """GSPO-token (eqs. 14-15) on a PackedBatch; advantages_T, or advantages_S broadcast to tokens."""
    logp_T, old_logp_T, weights_S, extra = _old_logp(batch, config)
    loss, metrics = gspo_token_loss(
        logp_T, old_logp_T, batch.loss_mask_T, batch.cu_seqlens_S1, _token_advantages(batch),
        clip_low=config.clip_low, clip_high=config.clip_high, num_global_sequences=batch.num_global_sequences,
        seq_weights_S=weights_S, entropy_T=batch.entropy_T, validate=config.validate,
    )
    return finish_loss(batch, config, loss, metrics, extra)


@register_loss("grpo", GRPOConfig)
def grpo(batch: PackedBatch, config: GRPOConfig) -> tuple[Tensor, dict]:
    """GRPO (eq. 2) on a PackedBatch; advantages_T, or advantages_S broadcast to tokens."""
    logp_T, old_logp_T, weights_S, extra = _old_logp(batch, config)
    loss, metrics = grpo_loss(
        logp_T, old_logp_T, batch.loss_mask_T, batch.cu_seqlens_S1, _token_advantages(batch),
        clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
        aggregation=config.aggregation, num_global_sequences=batch.num_global_sequences,
        num_global_tokens=batch.num_global_tokens, seq_weights_S=weights_S, entropy_T=batch.entropy_T,
        validate=config.validate,
    )
    return finish_loss(batch, config, loss, metrics, extra, aggregation=config.aggregation)
