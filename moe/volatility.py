"""Expert-activation volatility (GSPO paper §5.3): for the same tokens, the fraction of (token, layer, k)
expert choices under pi_theta that differ from those under pi_old. The paper reports ~10% after one
gradient update of the 48-layer Qwen3-30B-A3B; with routing replay on, the experts used equal pi_old's
and volatility is 0 by construction.

Legend: T tokens (storage order of `moe.routing_replay`), L MoE layers, K top-k.

Top-k is compared as a set per (token, layer): an expert chosen by both policies counts as unchanged
whatever its rank. Results stay tensors (no host sync); `volatility_counts` returns numerator and
denominator so data-parallel ranks can all-reduce them before dividing.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def _check_pair(old_TLK: Tensor, new_TLK: Tensor) -> None:
    if old_TLK.dim() != 3 or old_TLK.shape != new_TLK.shape:
        raise ValueError(
            f"volatility compares two [T, L, K] route tensors of one shape, got {tuple(old_TLK.shape)} and "
            f"{tuple(new_TLK.shape)}"
        )


def changed_choices(old_TLK: Tensor, new_TLK: Tensor) -> Tensor:
    """bool [T, L, K]: new_TLK[t, l, k] is not among old_TLK[t, l, :]."""
    _check_pair(old_TLK, new_TLK)
    old, new = old_TLK.long(), new_TLK.long()
    return ~(new[..., :, None] == old[..., None, :]).any(dim=-1)


def volatility_counts(old_TLK: Tensor, new_TLK: Tensor, mask_T: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(changed_L, total_L) float64 per MoE layer over the tokens in `mask_T` (all when None)."""
    changed_TLK = changed_choices(old_TLK, new_TLK)
    num_tokens, num_layers, topk = changed_TLK.shape
    if mask_T is None:
        weight_T = torch.ones(num_tokens, dtype=torch.float64, device=changed_TLK.device)
    else:
        if mask_T.shape != (num_tokens,):
            raise ValueError(f"mask must be [T={num_tokens}], got {tuple(mask_T.shape)}")
        weight_T = (mask_T != 0).to(torch.float64)
    changed_L = (changed_TLK.to(torch.float64).sum(dim=-1) * weight_T[:, None]).sum(dim=0)
    total_L = (weight_T.sum() * topk).expand(num_layers).clone()
    return changed_L, total_L


def expert_volatility(old_TLK: Tensor, new_TLK: Tensor, mask_T: Optional[Tensor] = None) -> Tensor:
    """Scalar fraction of (token, layer, k) choices under pi_theta (new) that differ from pi_old (old)."""
    changed_L, total_L = volatility_counts(old_TLK, new_TLK, mask_T)
    return changed_L.sum() / total_L.sum().clamp_min(1.0)


def volatility_metrics(old_TLK: Tensor, new_TLK: Tensor, mask_T: Optional[Tensor] = None, *,
                       group=None, moe_layers: Optional[tuple[int, ...]] = None,
                       prefix: str = "moe/expert_volatility") -> dict[str, Tensor]:
    """Per-step log entries: the overall fraction and one per MoE layer (named by global MoE-layer index,
    `moe_layers`, default 0..L-1). Counts are summed over `group` (e.g. the data-parallel group) first.
    Pipeline stages each report their own layers; the overall value is per stage."""
    changed_L, total_L = volatility_counts(old_TLK, new_TLK, mask_T)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        both = torch.stack([changed_L, total_L])
        torch.distributed.all_reduce(both, group=group)
        changed_L, total_L = both[0], both[1]
    layers = moe_layers if moe_layers is not None else tuple(range(changed_L.shape[0]))
    metrics = {prefix: changed_L.sum() / total_L.sum().clamp_min(1.0)}
    per_layer = changed_L / total_L.clamp_min(1.0)
    for i, layer in enumerate(layers):
        metrics[f"{prefix}/layer_{layer}"] = per_layer[i]
    return metrics


@torch.no_grad()
def measure_volatility(replay, run_forward: Callable[[], object], old_routes_TLK: Tensor,
                       mask_T: Optional[Tensor] = None, *, group=None) -> dict[str, Tensor]:
    """Run `run_forward()` (pi_theta's forward of the micro-batch whose pi_old routes are `old_routes_TLK`)
    WITHOUT replay, recording its routes with `replay` (a `moe.routing_replay.RoutingReplay`), and return
    `volatility_metrics` against pi_old. It must run outside any `replaying` context."""
    with replay.recording() as rec:
        run_forward()
    return volatility_metrics(old_routes_TLK, rec.routes, mask_T, group=group, moe_layers=replay.spec.moe_layers)


__all__ = ["changed_choices", "expert_volatility", "measure_volatility", "volatility_counts", "volatility_metrics"]
