"""Cold-start SFT and GSPO / GSPO-token / GRPO training on Megatron-Core with an embedded rollout engine."""

from .layout import check_layout
from .trainer import Trainer

__all__ = ["Trainer", "check_layout"]
