"""Cold-start SFT and GSPO / GSPO-token / GRPO training on Megatron-Core with an embedded rollout engine."""

from .trainer import Trainer, TrainError, check_layout

__all__ = ["TrainError", "Trainer", "check_layout"]
