"""The one error type for checkpoints on disk, shared by `moe` and `megagspo`.

It lives in `moe` because `moe` must never import `megagspo`: `moe.hf_checkpoint` (Hugging Face folders) and
`megagspo.checkpoint` (run checkpoints, the KL reference) both raise it, so a caller catches one class
whichever layer found the problem.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, corrupt, or does not fit this model / run: the message names the
    file or tensor and why (each tensor with both shapes where shapes differ)."""


__all__ = ["CheckpointError"]
