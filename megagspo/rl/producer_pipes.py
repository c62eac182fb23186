"""The rollout producer's two pipes (megagspo.rl.producer, megagspo.rl.producer_process), both ends, and the
signal mask it is spawned under.

Transport, chosen so that the trainer never waits on a producer that cannot answer. Two one-way pipes
(multiprocessing.Pipe(duplex=False)), each end held by one process only: the trainer closes its copies of the
producer's ends once the process has started.
- Results: the producer writes each batch as a frame (an 8-byte length, then the pickled batch). The trainer reads
  its end without blocking, a frame in pieces, and waits on the pipe and the process's sentinel together: a
  producer that dies closes the pipe's only write end and readies its sentinel, so the wait returns at once, a
  frame half received included; the process is then reaped (joined) and restarted. A multiprocessing Queue did not
  allow this: the trainer held the write end of its own queue's pipe (no end of file ever came), and a get() that
  had started on a message read until its end, so a producer SIGKILLed mid-batch left the trainer in read() for
  good. A deadline instead would have to outlast the slowest batch a run may generate.
- The queue bound: N slots (a semaphore, as a bounded Queue has); the producer takes one before it sends a batch,
  the trainer frees one per batch taken, so at most N batches are sent and not consumed (besides the weights'
  gate: batch k waits for version k - N).
- Commands (weights by version; first the start: spec, prompts, state) go through the other pipe, written by a
  thread of the trainer (a send never blocks the step), pickled in the caller (an error is the caller's). The
  producer holds its only read end: a send to a dead producer fails at once (EPIPE, which ends the thread) and
  never fills a pipe nobody reads; the trainer's end of file tells the producer that the trainer is gone. With
  the start there, the payload Process.start() writes is a few KB, within a pipe's buffer, so start() never waits
  on the child: spawn writes it while it still holds the child's read end, and a child that died mid-import had
  left start() writing a 308 KB payload forever.

Signals. A stop is the trainer's (megagspo.checkpoint.signals): it finishes its step, checkpoints with the batches
it holds and received, and ends the producer. The producer ignores SIGINT (a terminal's Ctrl-C reaches the whole
process group) and SIGTERM (a scheduler may signal the group): both are blocked in the trainer's thread while it
spawns the producer, so the producer starts with them blocked (a signal mask survives exec, a Python handler does
not) and is never stopped mid-import, and from its first line on it ignores them. The producer dies with the
trainer (PR_SET_PDEATHSIG, and end of file on the commands pipe).

Test hooks (environment variables the project never sets; tests/test_rollout_producer.py): with
MEGAGSPO_PRODUCER_TEST_TRACE=<file> the producer appends "<pid> <phase> <batch>" to <file> as it enters each phase:
start (its start message read, the engine to build), wait (for the batch's weights), make (generating and
scoring), idle (the batch made, waiting for a free slot), send (writing the batch's frame: after its first half).
With MEGAGSPO_PRODUCER_TEST_HOLD=<file> it stays in a phase it enters while <file> reads "<phase> <batch>" (or
"<phase>"), so that a test kills it there: mid-frame, say.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_any
from typing import Optional

STOPS = {signal.SIGINT, signal.SIGTERM}  # the trainer's to answer (megagspo.checkpoint.signals), never the producer's
FRAME_HEADER = struct.Struct("!Q")       # a results frame: its length in bytes, then the pickled ProducedBatch


@contextlib.contextmanager
def stops_blocked():
    """SIGINT / SIGTERM blocked in this thread, so that a process spawned here starts with them blocked (a signal
    mask survives exec); one that arrives meanwhile reaches the trainer when the block ends, never lost."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # its first start unblocks both signals in the calling thread: before ours
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(frozen=True)
class TestHooks:
    """The producer's test hooks (module docstring): a trace of its phases, and a hold in one of them."""

    trace: Optional[str] = None
    hold: Optional[str] = None

    @classmethod
    def from_env(cls) -> "TestHooks":
        return cls(os.environ.get("MEGAGSPO_PRODUCER_TEST_TRACE") or None,
                   os.environ.get("MEGAGSPO_PRODUCER_TEST_HOLD") or None)

    def enter(self, phase: str, k: int) -> None:
        if self.trace:
            with open(self.trace, "a") as f:
                f.write(f"{os.getpid()} {phase} {k}\n")
        while self.hold and self._held() in (phase, f"{phase} {k}"):
            time.sleep(0.01)

    def _held(self) -> str:
        try:
            with open(self.hold) as f:
                return f.read().strip()
        except OSError:
            return ""


def write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def send_frame(fd: int, payload: bytes, k: int, hooks: TestHooks) -> None:
    """Batch k into the results pipe as one frame (blocking writes: a full pipe waits for the trainer)."""
    body = memoryview(payload)
    half = len(body) // 2
    write_all(fd, memoryview(FRAME_HEADER.pack(len(body))))
    write_all(fd, body[:half])
    hooks.enter("send", k)
    write_all(fd, body[half:])


class CommandsEnd:
    """The producer's end of the commands pipe, read as a queue: get() / get_nowait(). The trainer's end of file
    (it ended, or died mid-message) reads as None, the stop."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def get(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def get_nowait(self):
        if not self.conn.poll():
            raise queue.Empty
        return self.get()


class Frames:
    """The trainer's end of the results pipe: frames read without blocking, in pieces as they arrive, so that a
    wait can look at the producer between reads, a frame half received included."""

    CHUNK = 1 << 20

    def __init__(self, conn) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.head = bytearray(FRAME_HEADER.size)
        self.body: Optional[bytearray] = None   # the frame being received, once its header is in
        self.filled = 0                         # bytes of head / body received
        self.ended = False                      # end of file: the producer's end is closed (it ended or died)

    def receive(self, timeout: float, sentinel=None) -> Optional[bytearray]:
        """A whole frame's payload; None when none completed within `timeout` (or as soon as `sentinel`, the
        process's, tells it ended: what it wrote before is read by a call with timeout 0)."""
        if not self.ended and timeout > 0:
            wait_for_any([self.fd] + ([sentinel] if sentinel is not None else []), timeout)
        while not self.ended:
            buffer = self.head if self.body is None else self.body
            want = min(len(buffer) - self.filled, self.CHUNK)
            try:
                n = os.readv(self.fd, [memoryview(buffer)[self.filled:self.filled + want]]) if want else 0
            except BlockingIOError:
                return None
            if want and n == 0:
                self.ended = True
                return None
            self.filled += n
            if self.filled < len(buffer):
                continue
            self.filled = 0
            if self.body is None:
                self.body = bytearray(FRAME_HEADER.unpack(self.head)[0])
            else:
                payload, self.body = self.body, None
                return payload
        return None

    def close(self) -> None:
        self.conn.close()


class Sender:
    """The trainer's end of the commands pipe: messages pickled by the caller (its errors are the caller's) and
    written by a thread of their own, so a send never blocks the step; a write to a producer that died fails at
    once (EPIPE: the producer held the only read end) and ends the thread."""

    _END = b""

    def __init__(self, conn) -> None:
        from multiprocessing.reduction import ForkingPickler  # torch's tensor reductions are registered with it

        self.conn, self.dumps = conn, ForkingPickler.dumps
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="megagspo-producer-commands", daemon=True)
        self.thread.start()

    def put(self, message) -> None:
        self.queue.put(bytes(self.dumps(message)))

    def _run(self) -> None:
        while (data := self.queue.get()) != self._END:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the producer died: its successor gets a pipe of its own
                return

    def close(self) -> None:
        self.queue.put(self._END)
        self.thread.join(timeout=10)
        self.conn.close()
