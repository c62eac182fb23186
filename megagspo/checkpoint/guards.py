"""Safe readers for user-supplied paths (and, re-exported, the verifier time limit of megagspo.rewards.bounded).

Only safe formats are read from user paths: safetensors, JSON, and `torch.load(..., weights_only=True)`
(which unpickles tensors and plain containers only, never arbitrary objects).
"""

from __future__ import annotations

import os
from typing import Dict

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


# The verifier time limit lives with the rewards (a worker process killed at its deadline); kept importable here.
from megagspo.rewards.bounded import VerifierTimeout, with_time_limit  # noqa: E402,F401
