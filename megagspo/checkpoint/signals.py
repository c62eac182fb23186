"""Preemption: SIGTERM / SIGINT -> finish the current step, checkpoint, exit non-zero; a second signal exits
at once.

The handler only sets a flag; the trainer polls `requested()` at step boundaries. Under several processes
the flag is OR-reduced over all ranks there, so every rank stops after the same step (a signal reaching
ranks at slightly different moments cannot make them disagree and deadlock).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

import torch

from moe.collective import collective_device


class Preempted(Exception):
    """Raised by the trainer after the checkpoint on a signal was written. `exit_code` = 128 + signal."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._old: dict = {}

    def install(self) -> None:
        """Idempotent (the Trainer installs it before its first write under the CLI, and again in train())."""
        if threading.current_thread() is not threading.main_thread() or self._old:
            return
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            sys.stderr.write(f"\nmegagspo: second signal ({name}): exiting at once, without a checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        sys.stderr.write(f"\nmegagspo: received {name}: finishing the current step, then writing a checkpoint "
                         "and exiting (send it again to exit at once)\n")
        sys.stderr.flush()

    def requested(self) -> Optional[int]:
        """The signal number when any rank got one (collective when several processes run), else None."""
        local = self.signum or 0
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            t = torch.tensor([local], dtype=torch.int64, device=collective_device())
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            local = int(t.item())
        return local or None
