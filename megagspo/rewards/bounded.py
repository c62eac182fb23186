"""A call bounded for real: each call runs in a persistent worker process, and a call still running at its
deadline gets the worker SIGKILLed and a timeout error; the next call starts a new worker. `BoundedCall` is the
mechanism (any `fn(*args, **kwargs)`, its result pickled back; the agent's tools run in it, megagspo.agent.tools);
`BoundedVerifier` is the reward's use of it: `fn(response, answer) -> float` bounded by `reward.timeout_s`, raising
VerifierTimeout / VerifierCrashed.

Why a process and not SIGALRM: math-verify (the `math` reward) reaches C-level big-integer arithmetic
(`\\boxed{10^{10^{10^{10}}}}` as a reference answer) that no Python signal handler interrupts, and it catches a
timeout exception itself, scoring the call as a wrong answer. A killed process cannot do either.

Cost: one pipe round trip per call (the arguments and the result pickled); the worker's start (process start plus
the function's `warmup`, e.g. importing math-verify) is paid once, and again after each cut-off call, and is
bounded by its own limit (`start_timeout_s`), never counted against the call's (`reward.timeout_s`).

The worker is a fresh Python interpreter (no trainer threads, CUDA context or process groups in it; the caller's
`__main__` is never re-run) when the function pickles by reference (every module-level registered reward or tool),
and a `fork` of the caller otherwise (a closure registered in a notebook or a test). On Linux a worker dies with its
trainer (PR_SET_PDEATHSIG), even mid C-level loop. Verifiers marked `in_process = True` (the
built-in string rewards: linear-time pure Python that cannot hang) run in the caller without a worker.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
from typing import Callable, Optional


class CallTimeout(Exception):
    """A bounded call ran past its time limit (its worker was SIGKILLed), or its worker did not start in time."""


class CallCrashed(RuntimeError):
    """A bounded call's worker process died mid-call or while starting (a segfault, out of memory, os._exit)."""


class VerifierTimeout(CallTimeout):
    """A verifier ran past reward.timeout_s; score_batch scores it 0 and counts it in reward/errors and
    reward/timeouts."""


class VerifierCrashed(CallCrashed):
    """The verifier's worker process died mid-call (a segfault, out of memory); counted in reward/errors."""


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this worker when the trainer dies, even mid C-level loop (no orphan left
    spinning); elsewhere the worker ends at its next read (EOF). The signal comes when the *thread* that started
    the worker ends, hence _Spawner."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _sendable_error(exc: Exception) -> Exception:
    """`exc` when it survives a pickle round trip, else a RuntimeError holding its type and text: an exception
    that pickles but does not unpickle (a required keyword argument) would otherwise fail in the caller's recv."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to travel
        return RuntimeError(f"{type(exc).__name__}: {str(exc)[:500]}")


def _serve(conn, fn, convert) -> None:
    """The worker: warm up, say ready, then answer (args, kwargs) requests with `convert(fn(*args, **kwargs))`
    until EOF or None."""
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
        args, kwargs = request
        try:
            value = fn(*args, **kwargs)
            reply = ("ok", value if convert is None else convert(value))
        except Exception as exc:  # noqa: BLE001 - returned to the caller, who counts it
            reply = ("error", _sendable_error(exc))
        try:
            conn.send(reply)  # pickled whole before a byte is written: a failure leaves the pipe in step
        except Exception:  # noqa: BLE001 - a result that does not pickle is the call's error
            kind, value = reply
            conn.send(("error", TypeError(f"the result, a {type(value).__name__}, does not pickle") if kind == "ok"
                       else RuntimeError(f"{type(value).__name__}: {str(value)[:500]}")))


def _worker_main(fd: int) -> None:
    """Entry of a fresh-interpreter worker: the trainer's sys.path, then the function and its result's
    conversion (pickled by reference)."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    sys.path[:] = conn.recv()
    fn, convert = conn.recv()
    _serve(conn, fn, convert)


def _pickles(obj) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:  # noqa: BLE001 - closures, lambdas, local functions
        return False


class _FreshWorker:
    """A new Python interpreter (subprocess): no trainer threads, CUDA context or process groups in it, and
    unlike multiprocessing's spawn/forkserver it never re-runs the caller's `__main__`."""

    def __init__(self, fn, convert, process_name: str) -> None:
        import subprocess
        from multiprocessing import Pipe

        self.conn, child = Pipe()
        code = "import sys; from megagspo.rewards.bounded import _worker_main; _worker_main(int(sys.argv[1]))"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(child.fileno())], pass_fds=(child.fileno(),),
                                     stdin=subprocess.DEVNULL, env=env)
        child.close()
        self.conn.send(list(sys.path))
        self.conn.send((fn, convert))

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
    """A fork of the caller, for functions that do not pickle (a closure registered in a notebook or a test)."""

    def __init__(self, fn, convert, process_name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, fn, convert), name=process_name, daemon=True)
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


class _Spawner:
    """Starts every worker from one thread that lives as long as the process. PR_SET_PDEATHSIG fires when the
    thread that started the child ends, not the process: a worker started from a short-lived thread (one rollout
    thread per trajectory calling a tool) would be SIGKILLed mid-call when that thread returned."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests, self._pid = None, None

    def start(self, kind, *args):
        """`kind(*args)` (a worker), run on the spawner thread; its exception re-raised here."""
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child (which has none of its parent's threads)
                self._requests, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=self._serve, args=(self._requests,), name="megagspo-worker-spawner",
                                 daemon=True).start()
            requests = self._requests
        done = queue.SimpleQueue()
        requests.put((kind, args, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(requests) -> None:
        while True:
            kind, args, done = requests.get()
            try:
                done.put((True, kind(*args)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the thread that asked
                done.put((False, exc))


_SPAWNER = _Spawner()


class BoundedCall:
    """`fn(*args, **kwargs)` run in a worker process, at most `seconds` per call (plus the pipe round trip and,
    after a cut-off call, the kill); returns `convert(result)` (converted in the worker) or the result itself,
    which must pickle. The function's own exception is re-raised in the caller; a call past its limit raises
    `timeout_error`, a worker that dies `crashed_error`. Thread-safe (calls are serialised); `close()` ends the
    worker. `what` names the function in those errors."""

    timeout_error: type = CallTimeout
    crashed_error: type = CallCrashed

    def __init__(self, fn: Callable, seconds: float, *, start_timeout_s: float = 120.0,
                 convert: Optional[Callable] = None, what: Optional[str] = None,
                 process_name: str = "megagspo-bounded") -> None:
        self.fn, self.seconds, self.start_timeout_s = fn, float(seconds), float(start_timeout_s)
        self.convert, self.process_name = convert, process_name
        self.what = what if what is not None else getattr(fn, "__name__", "the call")
        self.__wrapped__ = fn
        self._kind = _FreshWorker if _pickles((fn, convert)) else _ForkedWorker
        self._worker = None
        self._lock = threading.Lock()
        self.starts = 0  # worker processes started (1 + the number of cut-off or crashed calls)

    def _ran_past(self) -> str:
        return f"{self.what} ran past its time limit of {self.seconds:g} s (worker killed)"

    def _start(self) -> None:
        worker = self._worker = _SPAWNER.start(self._kind, self.fn, self.convert, self.process_name)
        self.starts += 1
        if not worker.conn.poll(self.start_timeout_s):
            self._stop()
            raise self.timeout_error(f"{self.what}'s worker did not start within {self.start_timeout_s:g} s")
        try:
            worker.conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise self.crashed_error(f"{self.what}'s worker died while starting (exit code "
                                     f"{worker.exitcode()})") from None

    def _stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.conn.close()
            worker.kill()

    def __call__(self, *args, **kwargs):
        with self._lock:
            if self._worker is None or not self._worker.alive():
                self._stop()
                self._start()
            worker = self._worker
            try:
                worker.conn.send((args, kwargs))
                reply = worker.conn.recv() if worker.conn.poll(self.seconds) else None
            except (EOFError, OSError):
                self._stop()
                raise self.crashed_error(f"{self.what}'s worker process died mid-call (exit code "
                                         f"{worker.exitcode()})") from None
            if reply is None:
                self._stop()  # SIGKILL: C-level loops included
                raise self.timeout_error(self._ran_past())
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


class BoundedVerifier(BoundedCall):
    """`fn(response, answer) -> float` run in a worker process, at most `seconds` per call (plus the pipe round
    trip and, after a cut-off call, the kill). Thread-safe (calls are serialised); `close()` ends the worker."""

    timeout_error = VerifierTimeout
    crashed_error = VerifierCrashed

    def __init__(self, fn: Callable[[str, str], float], seconds: float, *, start_timeout_s: float = 120.0) -> None:
        super().__init__(fn, seconds, start_timeout_s=start_timeout_s, convert=float, what="the verifier",
                         process_name="megagspo-verifier")

    def _ran_past(self) -> str:
        return f"verifier ran past reward.timeout_s = {self.seconds:g} s (worker killed)"

    def __call__(self, response: str, answer: str) -> float:
        return super().__call__(response, answer)


def with_time_limit(fn: Callable[[str, str], float], seconds: float) -> Callable[[str, str], float]:
    """`fn` bounded to `seconds` per call in a worker process (see the module doc); 0 = no limit, and a verifier
    marked `in_process = True` (cannot hang) runs as it is."""
    if not seconds or getattr(fn, "in_process", False):
        return fn
    return BoundedVerifier(fn, seconds)


__all__ = ["BoundedCall", "BoundedVerifier", "CallCrashed", "CallTimeout", "VerifierCrashed", "VerifierTimeout",
           "with_time_limit"]
