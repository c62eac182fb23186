"""Group-relative advantages (eq. 7): each response's reward against the other responses to its prompt.

Legend (docs/architecture.md): B prompts (groups), G responses per prompt (group size), R = B * G responses.

A_i = (r_i - mean(r_group)) / (std(r_group) + eps), or without the std division (`scale_by_std=False`).
A group whose rewards are all equal carries no signal: its advantages are exactly 0 (tested with max ==
min, since mean() of equal floats can differ from them in the last bit and 0/eps would then be ~1e-11,
not 0). G = 1 has no group to compare against and is a configuration error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .validation import require_positive_finite


@dataclass(frozen=True)
class GroupAdvantageConfig:
    """Group-normalised advantages (eq. 7)."""

    scale_by_std: bool = True       # false: A_i = r_i - mean r (no division by the group's std)
    eps: float = 1e-6               # A_i = (r_i - mean r) / (std r + eps); >= 0 (a tied group is exactly 0 at any eps)
    # torch.std's default (Bessel-corrected), as verl and TRL use; the paper does not say which.
    unbiased_std: bool = True

    def __post_init__(self) -> None:
        require_positive_finite("GroupAdvantageConfig", "eps", self.eps)


def group_advantages(
    rewards: Tensor,
    *,
    group_size: Optional[int] = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """Advantages of eq. 7 with the shape of `rewards`.

    rewards: [B, G] (`group_size` omitted or equal to G), or flat [B*G] with `group_size` = G, where
    responses to the same prompt are contiguous. NaN/inf rewards raise (naming the groups): a reward
    that could not be computed must be fixed or filtered upstream, not silently turned into a signal.
    """
    GroupAdvantageConfig(scale_by_std=scale_by_std, eps=eps, unbiased_std=unbiased_std)
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} but rewards_BG has shape {tuple(rewards.shape)}")
        rewards_BG = rewards
    elif rewards.dim() == 1:
        if group_size is None:
            raise ValueError(f"flat rewards of shape {tuple(rewards.shape)} need group_size (responses per prompt)")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if rewards.shape[0] % group_size != 0:
            raise ValueError(
                f"flat rewards of length {rewards.shape[0]} are not a whole number of groups of size {group_size}"
            )
        rewards_BG = rewards.reshape(-1, group_size)
    else:
        raise ValueError(f"rewards must be [B, G] or flat [B*G], got shape {tuple(rewards.shape)}")

    num_groups, g = rewards_BG.shape
    if g < 2:
        raise ValueError(
            f"group size G={g}: group advantages (eq. 7) need at least 2 responses per prompt; "
            "G=1 always gives zero advantage, so it is a configuration error"
        )
    bad_BG = ~torch.isfinite(rewards_BG)
    if bool(bad_BG.any()):
        groups = torch.nonzero(bad_BG.any(dim=1)).flatten()[:8].tolist()
        raise ValueError(
            f"rewards hold {int(bad_BG.sum())} NaN/inf value(s), in group(s) {groups} of {num_groups}; "
            "fix or drop those samples before computing advantages"
        )

    mean_B1 = rewards_BG.mean(dim=1, keepdim=True)
    centered_BG = rewards_BG - mean_B1
    if scale_by_std:
        std_B1 = rewards_BG.std(dim=1, keepdim=True, unbiased=unbiased_std)
        centered_BG = centered_BG / (std_B1 + eps)
    flat_B1 = rewards_BG.amax(dim=1, keepdim=True) == rewards_BG.amin(dim=1, keepdim=True)
    adv_BG = torch.where(flat_B1, torch.zeros_like(centered_BG), centered_BG)
    return adv_BG.reshape(rewards.shape)
