"""Expert-activation volatility (GSPO paper §5.3): for the same tokens, the fraction of (token, layer, k)
expert choices under pi_theta that differ from those under pi_old. The paper reports ~10% after one
gradient update of the 48-layer Qwen3-30B-A3B; with routing replay on, the experts used equal pi_old's
and volatility is 0 by construction.

Legend (docs/architecture.md): T tokens (storage order of `moe.routing_replay`), K top-k; L here is the MoE
layers of this stage (Ly in the shared legend), as in `moe.routing_replay`.

Top-k is compared as a set per (token, layer): an expert chosen by both policies counts as unchanged
whatever its rank. `volatility_counts` returns numerator and denominator as tensors (no host sync) so ranks
can sum them before dividing; `VolatilityTally` keeps those sums over the micro-batches of one RL step.
Routes come from `moe.routing_replay.RoutingReplay.recording()` (pi_theta's free forward) and from pi_old's
forward or the rollout engine (R3).
"""

from __future__ import annotations

from typing import Optional

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


class VolatilityTally:
    """Running (changed, total) (token, layer, k) counts over the micro-batches of one RL step, for a trainer
    that sums them over pipeline stages and data-parallel ranks before dividing (`fraction`).

        tally = VolatilityTally()
        for old_TLK, new_TLK, mask_T in micro_batches:  # pi_old's routes and pi_theta's, same tokens
            tally.add(old_TLK, new_TLK, mask_T)
        changed, total = all_reduce(tally.counts())
        volatility = VolatilityTally.fraction(changed, total)

    Counts are Python floats, added one micro-batch at a time (one host sync per micro-batch, at the end of
    its update), so the sums match the trainer's metrics row exactly."""

    def __init__(self) -> None:
        self.changed = 0.0
        self.total = 0.0

    def add(self, old_TLK: Tensor, new_TLK: Tensor, mask_T: Optional[Tensor] = None) -> None:
        changed_L, total_L = volatility_counts(old_TLK, new_TLK, mask_T)
        self.changed += float(changed_L.sum())
        self.total += float(total_L.sum())

    def counts(self) -> list[float]:
        """[changed, total]: what to sum over ranks."""
        return [self.changed, self.total]

    @staticmethod
    def fraction(changed: float, total: float) -> float:
        """changed / total, 0 when no token was compared."""
        return changed / max(total, 1.0)


__all__ = ["VolatilityTally", "changed_choices", "expert_volatility", "volatility_counts"]
