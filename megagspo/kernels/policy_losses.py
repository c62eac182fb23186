"""The registered policy losses through the fused segmented GSPO kernel: drop-in `(batch, config)` entry points
for `megagspo.algorithm.get_loss(name)` with the same loss, gradient and metrics (config rl.loss.impl=kernels);
and `build_loss(cfg.rl)`, the run's one route from the rl sections to a loss (torch or fused) and its Config.

Legend (docs/architecture.md): T packed tokens; packed sequences spelled `_S` in names here, `_S1` their
count + 1 offsets (`cu_seqlens_S1`).

    loss_fn = fused_loss("gspo")            # or "gspo_token"; any other name raises, naming the fused ones
                                            # impl="fused" (default): the megagspo._C kernel or an error
    loss, metrics = loss_fn(batch, config)  # batch: megagspo.algorithm.PackedBatch, config: GSPOConfig

What the kernel serves, and what it refuses (a clear error, never a silent fallback to the torch loss):
- GSPO (eq. 6): the kernel's loss and d loss / d logp (eq. 11) are the algorithm's.
- GSPO-token (eq. 14) with per-sequence advantages A_it = A_i: its value, clipping and gradient equal GSPO's
  (s_it has the value s_i and d s_it / d logp_t = s_i, eq. 17; the paper's remark after eq. 18), so the same
  kernel serves it. Per-token advantages (batch.advantages_T) are refused: the kernel takes A_i.
- The rollout importance correction (per-sequence weights) is refused: the kernel has no sequence weights.
- GRPO (token ratios, eq. 2) has no fused kernel: refused by name.
The KL penalty (k3 to pi_ref) is added in torch, aggregated as in megagspo.algorithm.losses (a per-token
term, not a hot path). The metrics are computed from the kernel's per-sequence outputs (no extra pass over
logits: O(T) torch ops on detached tensors).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple

from torch import Tensor

from megagspo.algorithm.losses import finish_loss
from megagspo.algorithm.metrics import clip_metrics
from megagspo.algorithm.old_policy import resolve_old_logp
from megagspo.algorithm.rollout_correction import SEQUENCE_CORRECTIONS, apply_token_weights
from megagspo.algorithm.packing import as_bool_mask, segment_ids
from megagspo.algorithm.ratios import masked_segment_mean, token_log_ratio
from megagspo.algorithm.registry import LossOptionError, build_loss_config, get_loss
from megagspo.algorithm.validation import check_finite, check_same_shape
from megagspo.kernels import IMPLS, gspo_segment_loss

FUSED_LOSSES = ("gspo", "gspo_token")


def fused_loss(name: str, impl: str = "fused") -> Callable:
    """The fused-kernel entry point of registered loss `name`; ValueError for a loss the kernel cannot serve.

    impl is gspo_segment_loss's: "fused" (rl.loss.impl=kernels) runs the megagspo._C kernel or raises where it
    cannot serve the tensors' device, never a silent fallback; "auto" / "reference" are for tests."""
    if name not in FUSED_LOSSES:
        raise ValueError(f"megagspo.kernels: no fused kernel for loss {name!r}; fused losses: "
                         f"{', '.join(FUSED_LOSSES)} (use the torch loss, rl.loss.impl=torch)")
    if impl not in IMPLS:
        raise ValueError(f"megagspo.kernels.fused_loss: impl must be one of {IMPLS}; got {impl!r}")
    return functools.partial(_fused_gspo, impl=impl)


def _fused_gspo(batch, config, *, impl: str = "fused") -> tuple[Tensor, dict]:
    """GSPO / GSPO-token with per-sequence advantages through megagspo.kernels.gspo_segment_loss."""
    if batch.advantages_S is None:
        raise ValueError("megagspo.kernels fused GSPO loss: needs per-sequence advantages_S (the kernel takes A_i); "
                         "per-token advantages_T need the torch loss (rl.loss.impl=torch)")
    old_logp_T, weights_S, weights_T, extra = resolve_old_logp(batch, config.old_policy)
    if weights_S is not None:
        raise ValueError("megagspo.kernels fused GSPO loss: the rollout correction weights sequences, which the "
                         "kernel does not; use the torch loss (rl.loss.impl=torch)")
    # a token correction scales the gradient of logp_T per token, ahead of the kernel (its value is unchanged)
    logp_T = apply_token_weights(batch.logp_T, weights_T, batch.loss_mask_T)
    mask_T = as_bool_mask(batch.loss_mask_T)
    if config.validate:
        check_same_shape("logp_T", batch.logp_T, old_logp_T=old_logp_T, loss_mask_T=batch.loss_mask_T)
        check_finite("logp_T", batch.logp_T, mask_T)
        check_finite("old_logp_T", old_logp_T, mask_T)
        check_finite("advantages_S", batch.advantages_S)
    loss, k = gspo_segment_loss(
        logp_T, old_logp_T, mask_T, batch.cu_seqlens_S1, batch.advantages_S,
        clip_low=config.clip_low, clip_high=config.clip_high, num_global_sequences=batch.num_global_sequences,
        impl=impl)

    # metrics as the torch loss reports them, from the kernel's per-sequence ratios and clip decisions
    num_seqs = batch.cu_seqlens_S1.shape[0] - 1
    seq_id_T = segment_ids(batch.cu_seqlens_S1, batch.logp_T.shape[0])
    log_ratio_T = token_log_ratio(batch.logp_T.detach(), old_logp_T, mask_T)
    _, lengths_S = masked_segment_mean(log_ratio_T, mask_T, seq_id_T, num_seqs)
    adv_S = batch.advantages_S.detach()
    clip_high_S = k["clipped_S"] & (adv_S > 0)
    clip_low_S = k["clipped_S"] & (adv_S < 0)
    metrics = clip_metrics(
        ratio_X=k["ratio_S"], valid_X=lengths_S > 0,
        clip_low_tok=mask_T & clip_low_S[seq_id_T], clip_high_tok=mask_T & clip_high_S[seq_id_T],
        clip_low_seq=clip_low_S, clip_high_seq=clip_high_S,
        mask_T=mask_T, lengths_S=lengths_S, log_ratio_T=log_ratio_T, entropy_T=batch.entropy_T,
    )
    metrics["loss/policy"] = loss.detach()
    return finish_loss(batch, config, loss, metrics, extra)  # the torch losses' KL term and totals


# ---- the choice between the torch losses and the fused kernel (rl.loss.impl) ------------------------------
def build_loss(rl_cfg) -> Tuple[Callable, Any]:
    """-> (loss_fn, loss_cfg): the registered loss `rl_cfg.loss.name` and its Config built from the rl sections.

    rl_cfg.loss.impl == "kernels" returns the fused segmented-GSPO entry point (megagspo.kernels.policy_losses)
    forced onto the megagspo._C kernels: where they cannot serve the tensors' device the first call raises,
    it never falls back to the pure-torch reference. Losses and options the kernel cannot compute (grpo,
    the rollout correction's per-sequence weights) are refused here, before any compute.
    """
    loss_cfg = build_loss_config(rl_cfg)
    if check_loss_impl(rl_cfg) == "torch":
        return get_loss(rl_cfg.loss.name), loss_cfg
    return fused_loss(rl_cfg.loss.name, impl="fused"), loss_cfg


def check_loss_impl(rl_cfg) -> str:
    """rl.loss.impl, refused (LossOptionError) where the fused kernel cannot compute the configured loss."""
    loss, impl = rl_cfg.loss.name, rl_cfg.loss.impl
    if impl == "torch":
        return impl
    if impl != "kernels":
        raise LossOptionError(f"rl.loss.impl = {impl!r} is not valid; valid values: torch, kernels")
    if loss not in FUSED_LOSSES:
        raise LossOptionError(f"rl.loss.impl = 'kernels' has no fused kernel for rl.loss.name = {loss!r} (fused: "
                              f"{', '.join(FUSED_LOSSES)}); set rl.loss.impl=torch")
    correction = rl_cfg.old_policy.correction.method
    if correction in SEQUENCE_CORRECTIONS:
        raise LossOptionError(f"rl.loss.impl = 'kernels': the fused GSPO kernel has no per-sequence weights, so "
                              f"rl.old_policy.correction.method={correction} needs rl.loss.impl=torch (token_tis "
                              "and token_mask work with the kernel)")
    return impl


__all__ = ["FUSED_LOSSES", "build_loss", "check_loss_impl", "fused_loss"]
