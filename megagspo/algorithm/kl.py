"""KL penalty against a reference policy, per token (the term the paper omits from eq. 1 "for brevity").

Legend: T = packed tokens.

Samples come from the policy, so with d_t = log pi_ref(y_t) - log pi_theta(y_t):
  k1 = -d_t                   (unbiased, can be negative)
  k3 = exp(d_t) - d_t - 1     (unbiased, always >= 0, lower variance; Schulman's estimator)
Off by default for GSPO (coef 0): the paper's authors train without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .packing import as_bool_mask, compute_dtype
from .validation import require_choice, require_positive_finite

KL_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class KLConfig:
    """The KL penalty to a frozen reference policy (the GSPO paper trains without)."""

    coef: float = 0.0               # loss += coef * KL(pi_theta || pi_ref); 0 = off (no reference model is built)
    estimator: str = "k3"           # k3 = exp(d) - d - 1 (>= 0, low variance) | k1 = -d, d = log pi_ref - log pi

    def __post_init__(self) -> None:
        require_positive_finite("KLConfig", "coef", self.coef)
        require_choice("KLConfig", "estimator", self.estimator, KL_ESTIMATORS)

    @property
    def enabled(self) -> bool:
        return self.coef > 0


def token_kl(logp_T: Tensor, ref_logp_T: Tensor, loss_mask_T: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate; 0 outside the response mask."""
    require_choice("token_kl", "estimator", estimator, KL_ESTIMATORS)
    dtype = compute_dtype(logp_T)
    mask_T = as_bool_mask(loss_mask_T)
    zero = torch.zeros((), dtype=dtype, device=logp_T.device)
    # Masked positions are zeroed before exp so a -inf prompt log-prob cannot make inf - inf = NaN.
    d_T = torch.where(mask_T, ref_logp_T.detach().to(dtype) - logp_T.to(dtype), zero)
    if estimator == "k1":
        return -d_T
    return torch.where(mask_T, torch.expm1(d_T) - d_T, zero)
