"""The learning-rate schedule: a pure function of the step, so a checkpoint's step is the scheduler's state."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, base: float, warmup: int, schedule: str, min_ratio: float) -> float:
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return base
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return base * (1.0 - (1.0 - min_ratio) * frac)
    return base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))
