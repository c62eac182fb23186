"""A stop while a command starts (Ctrl-C = SIGINT, or SIGTERM): one line, exit 128 + signal, nothing written.

The first seconds of `megagspo train` import torch, Megatron-Core and transformers, then check the config, data
and model; Python's own SIGINT handling ended a stop there in a KeyboardInterrupt traceback from whichever
library was importing, and SIGTERM killed the process without a word. The CLI calls `arm()` before it imports
anything heavy: from then on both signals raise StoppedDuringStartup, which the CLI turns into one line.

Before the trainer writes anything in the run folder it hands the signals over to
megagspo.checkpoint.signals.StopRequest (finish the step, checkpoint, exit 128 + signal), and the CLI disarms the
guard before any other command writes, so a StoppedDuringStartup that reaches the CLI has written nothing. A
second signal while the first one unwinds exits at once.

Standard library only: this module is imported before torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StoppedDuringStartup(KeyboardInterrupt):
    """A signal before anything was written. A KeyboardInterrupt, so that code which cleans up after Ctrl-C
    (the run-folder lock, the ablation runner's cells) does so for SIGTERM here too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum


_previous: dict = {}
_raised = False


def _handle(signum, frame) -> None:
    global _raised
    if _raised:  # the first stop is unwinding (or a library swallowed it): do not wait for it
        sys.stderr.write(f"\nmegagspo: second signal ({signal.Signals(signum).name}): exiting at once\n")
        sys.stderr.flush()
        os._exit(128 + signum)
    _raised = True
    raise StoppedDuringStartup(signum)


def arm() -> None:
    """SIGINT / SIGTERM raise StoppedDuringStartup from now on (main thread only: Python delivers signals there)."""
    global _raised
    if threading.current_thread() is not threading.main_thread() or _previous:
        return
    _raised = False
    for sig in SIGNALS:
        _previous[sig] = signal.signal(sig, _handle)


def armed() -> bool:
    """Whether a signal now stops the command at once (the guard is the current handler)."""
    return bool(_previous) and signal.getsignal(signal.SIGINT) is _handle


def disarm() -> None:
    """The handlers from before arm() (Python's defaults in the CLI): the command is past start-up and writes now,
    or has ended. Idempotent."""
    for sig, old in list(_previous.items()):
        signal.signal(sig, old)
    _previous.clear()


__all__ = ["SIGNALS", "StoppedDuringStartup", "arm", "armed", "disarm"]
