"""The registered policy losses through the fused segmented GSPO kernel: drop-in `(batch, config)` entry points
for `megagspo.algorithm.get_loss(name)` with the same loss, gradient and metrics (config rl.loss_impl=kernels).

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
from typing import Callable

from torch import Tensor

FUSED_LOSSES = ("gspo", "gspo_token")


def fused_loss(name: str, impl: str = "fused") -> Callable:
    """The fused-kernel entry point of registered loss `name`; ValueError for a loss the kernel cannot serve.

    impl is gspo_segment_loss's: "fused" (rl.loss_impl=kernels) runs the megagspo._C kernel or raises where it
    cannot serve the tensors' device, never a silent fallback; "auto" / "reference" are for tests."""
    if name not in FUSED_LOSSES:
        raise ValueError(f"megagspo.kernels: no fused kernel for loss {name!r}; fused losses: "
                         f"{', '.join(FUSED_LOSSES)} (use the torch loss, rl.loss_impl=torch)")
    from . import IMPLS

    if impl not in IMPLS:
        raise ValueError(f"megagspo.kernels.fused_loss: impl must be one of {IMPLS}; got {impl!r}")
    return functools.partial(_fused_gspo, impl=impl)


def _fused_gspo(batch, config, *, impl: str = "fused") -> tuple[Tensor, dict]:
    """GSPO / GSPO-token with per-sequence advantages through megagspo.kernels.gspo_segment_loss."""
    from megagspo.algorithm.losses import finish_loss
    from megagspo.algorithm.metrics import clip_metrics
    from megagspo.algorithm.old_policy import resolve_old_logp
    from megagspo.algorithm.packing import as_bool_mask, segment_ids
    from megagspo.algorithm.ratios import masked_segment_mean, token_log_ratio
    from megagspo.algorithm.validation import check_finite, check_same_shape

    from . import gspo_segment_loss

    if batch.advantages_S is None:
        raise ValueError("megagspo.kernels fused GSPO loss: needs per-sequence advantages_S (the kernel takes A_i); "
                         "per-token advantages_T need the torch loss (rl.loss_impl=torch)")
    old_logp_T, weights_S, extra = resolve_old_logp(batch, config.old_policy)
    if weights_S is not None:
        raise ValueError("megagspo.kernels fused GSPO loss: the rollout importance correction weights sequences, "
                         "which the kernel does not; use the torch loss (rl.loss_impl=torch)")
    mask_T = as_bool_mask(batch.loss_mask_T)
    if config.validate:
        check_same_shape("logp_T", batch.logp_T, old_logp_T=old_logp_T, loss_mask_T=batch.loss_mask_T)
        check_finite("logp_T", batch.logp_T, mask_T)
        check_finite("old_logp_T", old_logp_T, mask_T)
        check_finite("advantages_S", batch.advantages_S)
    loss, k = gspo_segment_loss(
        batch.logp_T, old_logp_T, mask_T, batch.cu_seqlens_S1, batch.advantages_S,
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


__all__ = ["FUSED_LOSSES", "fused_loss"]
