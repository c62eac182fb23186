"""What a component may do to the run around it, as plain callables the Trainer provides: log a metrics row,
print a line, draw a progress bar, ask whether a stop signal arrived, and build the error that stops the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class RunHooks:
    log: Callable[[dict], None]                       # one metrics row (metrics.jsonl, TensorBoard)
    say: Callable[[str], None]                        # a line for the user (rank 0 prints)
    progress: Callable[[int, str], Optional[object]]  # (total, description) -> a tqdm bar, or None
    stop_requested: Callable[[], Optional[int]]       # collective: the signal number when any rank got one
    preempted: Callable[[str, int], BaseException]    # (message, signal number) -> the error to raise
