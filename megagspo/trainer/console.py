"""What a run shows on the terminal: lines printed by global rank 0, and tqdm progress bars (log.progress)
unless the run is quiet or this rank is not rank 0."""

from __future__ import annotations

from typing import Optional

from tqdm import tqdm


class Console:
    def __init__(self, is_main: bool, show_progress: bool) -> None:
        """is_main: this rank prints (global rank 0); show_progress: bars are drawn (log.progress, not quiet,
        rank 0)."""
        self.is_main = is_main
        self.show_progress = show_progress

    def say(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)

    def progress(self, total: int, desc: str) -> Optional[tqdm]:
        """A progress bar of `total` steps, or None where none is drawn."""
        return tqdm(total=total, desc=desc, dynamic_ncols=True) if self.show_progress else None
