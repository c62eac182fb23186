"""The engine's count of weight versions, one object shared by the parts that number things with it: every
sync path (the servers' `weight_version` after an update) and the checkpoint folders (`weights-v<k>`, also
those written on request by `write_hf_checkpoint`). Sharing it keeps one sequence whichever path runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WeightVersion:
    """value: the last version taken (0: none yet). A disk sync takes its number before writing (a failed write
    uses it up); the in-memory syncs take theirs once every bucket was accepted."""
    value: int = 0
