"""A verifier bounded for real: each call runs in a persistent worker process, and a call still running at its
deadline (`reward.timeout_s`) gets the worker SIGKILLed and a VerifierTimeout; the next call starts a new worker.

Why a process and not SIGALRM: math-verify (the `math` reward) reaches C-level big-integer arithmetic
(`\\boxed{10^{10^{10^{10}}}}` as a reference answer) that no Python signal handler interrupts, and it catches a
timeout exception itself, scoring the call as a wrong answer. A killed process cannot do either.

Cost: one pipe round trip per call (the strings pickled both ways); the worker's start (process start plus the
verifier's `warmup`, e.g. importing math-verify) is paid once, and again after each cut-off call, and is bounded
by its own limit (`start_timeout_s`), never counted against `reward.timeout_s`.

The worker is a fresh Python interpreter (no trainer threads, CUDA context or process groups in it; the caller's
`__main__` is never re-run) when the verifier pickles by reference (every module-level registered reward), and a
`fork` of the caller otherwise (a closure registered in a notebook or a test). On Linux a worker dies with its
trainer (PR_SET_PDEATHSIG), even mid C-level loop. Verifiers marked `in_process = True` (the
built-in string rewards: linear-time pure Python that cannot hang) run in the caller without a worker.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
from typing import Callable


class VerifierTimeout(Exception):
    """A verifier ran past reward.timeout_s; score_batch scores it 0 and counts it in reward/errors and
    reward/timeouts."""


class VerifierCrashed(RuntimeError):
    """The verifier's worker process died mid-call (a segfault, out of memory); counted in reward/errors."""


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this worker when the trainer dies, even mid C-level loop (no orphan left
    spinning); elsewhere the worker ends at its next read (EOF)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn, fn) -> None:
    """The worker: warm up, say ready, then answer (response, answer) requests until EOF or None."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole process group: the trainer decides
    warmup = getattr(fn, "warmup", None)
    if warmup is not None:
        try:
            warmup()
        except Exception:  # noqa: BLE001 - a broken verifier reports its failure on the first real call
            pass
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if request is None:
            return
        try:
            reply = ("ok", float(fn(*request)))
        except Exception as exc:  # noqa: BLE001 - returned to the caller, who counts it
            reply = ("error", exc)
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
            conn.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {str(reply[1])[:500]}")))


def _worker_main(fd: int) -> None:
    """Entry of a fresh-interpreter worker: the trainer's sys.path, then the verifier (pickled by reference)."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    sys.path[:] = conn.recv()
    _serve(conn, conn.recv())


def _pickles(fn) -> bool:
    try:
        pickle.dumps(fn)
        return True
    except Exception:  # noqa: BLE001 - closures, lambdas, local functions
        return False


class _FreshWorker:
    """A new Python interpreter (subprocess): no trainer threads, CUDA context or process groups in it, and
    unlike multiprocessing's spawn/forkserver it never re-runs the caller's `__main__`."""

    def __init__(self, fn) -> None:
        import subprocess
        from multiprocessing import Pipe

        self.conn, child = Pipe()
        code = "import sys; from megagspo.rewards.bounded import _worker_main; _worker_main(int(sys.argv[1]))"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(child.fileno())], pass_fds=(child.fileno(),),
                                     stdin=subprocess.DEVNULL, env=env)
        child.close()
        self.conn.send(list(sys.path))
        self.conn.send(fn)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exitcode(self):
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except Exception:  # noqa: BLE001 - a zombie the kernel reaps with us
            pass


class _ForkedWorker:
    """A fork of the caller, for verifiers that do not pickle (a closure registered in a notebook or a test)."""

    def __init__(self, fn) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, fn), name="megagspo-verifier", daemon=True)
        self.proc.start()
        child.close()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def exitcode(self):
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)


class BoundedVerifier:
    """`fn(response, answer) -> float` run in a worker process, at most `seconds` per call (plus the pipe round
    trip and, after a cut-off call, the kill). Thread-safe (calls are serialised); `close()` ends the worker."""

    def __init__(self, fn: Callable[[str, str], float], seconds: float, *, start_timeout_s: float = 120.0) -> None:
        self.fn, self.seconds, self.start_timeout_s = fn, float(seconds), float(start_timeout_s)
        self.__wrapped__ = fn
        self._kind = _FreshWorker if _pickles(fn) else _ForkedWorker
        self._worker = None
        self._lock = threading.Lock()
        self.starts = 0  # worker processes started (1 + the number of cut-off or crashed calls)

    def _start(self) -> None:
        worker = self._worker = self._kind(self.fn)
        self.starts += 1
        if not worker.conn.poll(self.start_timeout_s):
            self._stop()
            raise VerifierTimeout(f"the verifier's worker did not start within {self.start_timeout_s:g} s")
        try:
            worker.conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise VerifierCrashed(f"the verifier's worker died while starting (exit code {worker.exitcode()})") \
                from None

    def _stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.conn.close()
            worker.kill()

    def __call__(self, response: str, answer: str) -> float:
        with self._lock:
            if self._worker is None or not self._worker.alive():
                self._stop()
                self._start()
            worker = self._worker
            try:
                worker.conn.send((response, answer))
                reply = worker.conn.recv() if worker.conn.poll(self.seconds) else None
            except (EOFError, OSError):
                self._stop()
                raise VerifierCrashed(f"the verifier's worker process died mid-call (exit code "
                                      f"{worker.exitcode()})") from None
            if reply is None:
                self._stop()  # SIGKILL: C-level loops included
                raise VerifierTimeout(f"verifier ran past reward.timeout_s = {self.seconds:g} s (worker killed)")
        kind, value = reply
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                try:
                    self._worker.conn.send(None)
                except OSError:
                    pass
            self._stop()

    def __del__(self) -> None:
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the worker ends with us (EOF, PDEATHSIG)
            pass


def with_time_limit(fn: Callable[[str, str], float], seconds: float) -> Callable[[str, str], float]:
    """`fn` bounded to `seconds` per call in a worker process (see the module doc); 0 = no limit, and a verifier
    marked `in_process = True` (cannot hang) runs as it is."""
    if not seconds or getattr(fn, "in_process", False):
        return fn
    return BoundedVerifier(fn, seconds)


__all__ = ["BoundedVerifier", "VerifierCrashed", "VerifierTimeout", "with_time_limit"]
