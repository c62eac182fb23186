"""Safe readers for user-supplied paths and a time limit for verifiers.

Only safe formats are read from user paths: safetensors, JSON, and `torch.load(..., weights_only=True)`
(which unpickles tensors and plain containers only, never arbitrary objects).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Dict

import torch

from .store import CheckpointError


def load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a truncated or foreign file is a CheckpointError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None


def safe_torch_load(path: str):
    """torch.load restricted to tensors and plain containers (weights_only=True)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle safely is the same user-facing error
        raise CheckpointError(f"{path}: cannot be read as a weights-only torch file "
                              f"(truncated, corrupt, or holds code objects): {type(exc).__name__}: {exc}") from None


class VerifierTimeout(Exception):
    """A verifier ran past reward.timeout_s; score_batch scores it 0 and counts it in reward/errors."""


def with_time_limit(fn: Callable[[str, str], float], seconds: float) -> Callable[[str, str], float]:
    """Wrap a verifier so one call raises VerifierTimeout after `seconds` (SIGALRM; main thread only — off
    the main thread the call runs unlimited). 0 = no limit."""
    if not seconds:
        return fn

    def timed(response: str, answer: str) -> float:
        if threading.current_thread() is not threading.main_thread():
            return fn(response, answer)

        def on_alarm(signum, frame):
            raise VerifierTimeout(f"verifier ran past reward.timeout_s = {seconds} s")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(response, answer)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    timed.__wrapped__ = fn
    return timed
