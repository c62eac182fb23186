"""A rollout producer in its own process (`rollout.staleness: N` with `rollout.producer: process`): the embedded
engine generates and scores batches on its own threads / cores while the trainer updates, up to N policy versions
ahead, and hands them over through a bounded queue.

Legend: B prompts of this data-parallel rank's share, G samples per prompt, R = B G responses, L response length.

Each batch is made by the one batch maker (megagspo.rl.batch_maker), as in the trainer, with this process's
engine and verifier.

Versions. Version v is the policy after v RL updates (the run's step count). Batch k (the batch update k consumes)
is generated with exactly version `max(k - N, floor)` (floor: the version the producer stream started from), never
a newer one, although a newer one may already have arrived: the run is a function of the seed, not of timing,
so a resumed run repeats the uninterrupted one bit for bit. Batch k thus waits for the weights after update
k - N - 1, which the trainer sends once it has consumed batch k - N - 1: at most N batches are ever produced and
not consumed (the queue bound), and every token of batch k is at most N versions old when update k consumes it.
N = 1 is the one-step-off order of megagspo.rl.rollouts_ahead (the same draws, the same generator).

Partial rollouts (`rollout.partial: true`). Batch k still starts with version max(k - N, floor), or a newer one that
has already arrived (the engine takes it before its first token), but the weights that arrive while it is generated no longer wait for it: the engine stops its
unfinished responses, loads them and continues the responses from their prefix (`RolloutEngine.generate`'s
`switch`), so later tokens come from fresher weights; every token carries the version that sampled it
(RolloutOutput.version_RL) and its behaviour log-prob is that version's. The oldest token is still at most N
versions old. Where the switches fall depends on when the weights arrive: a partial run is a function of the seed
AND of timing (as in every framework that has partial rollouts), so it is not replayed bit for bit by a resume.

The process. `torch.multiprocessing`'s spawn context (a fresh interpreter: no trainer threads, process groups or
CUDA context); its own intra-op threads and, where asked, its own cores (`rollout.producer_threads`,
`rollout.producer_cpus`). It holds a copy of the prompt stream, the engine's sampling generator and the
verifier; it draws prompts, generates, scores and (dynamic sampling) draws more rounds until its share holds
enough informative groups, all without a collective: each data-parallel rank's producer draws the same global
stream and keeps its own share, so ranks that need different numbers of rounds never collide on a prompt.
Weights arrive by version, as the streamed buckets of the engine link (cloned off the trainer's parameters, in
shared memory). Each batch goes out with the producer's state after it (stream position, generator state), so
the trainer can restart a dead producer, or resume from a checkpoint, exactly where the last batch it received
left off: no sample is lost or produced twice.

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
import dataclasses
import os
import pickle
import queue
import signal
import struct
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any
from typing import Callable, Optional

import torch

from megagspo.config import RolloutConfig
from megagspo.config_training import FilterConfig, RLBatchConfig
from megagspo.data.datasets import PromptDataset
from megagspo.data.tokenizer import Tokenizer
from megagspo.rewards import RewardStats, get_reward, score_batch
from megagspo.rewards.bounded import with_time_limit
from megagspo.rl.batch_maker import BatchMaker, Rollouts, ScoredRollouts
from megagspo.rollout import SamplingParams, get_engine_class
from moe.architecture import Qwen3MoeArchitecture
from moe.parallel import DPShare


@dataclass(frozen=True)
class EngineRecipe:
    """How to build the run's rollout engine in another process: the registered name and its arguments."""

    name: str
    arch: Qwen3MoeArchitecture
    tokenizer: Tokenizer
    kwargs: dict = field(default_factory=dict)

    def build(self):
        return get_engine_class(self.name)(self.arch, self.tokenizer, **self.kwargs)


@dataclass(frozen=True)
class RewardRecipe:
    """The verifier in another process: reward.name under reward.timeout_s, or an injected (picklable) function."""

    name: str
    timeout_s: float
    fn: Optional[Callable] = None

    def build(self) -> Callable:
        return self.fn if self.fn is not None else with_time_limit(get_reward(self.name), self.timeout_s)


@dataclass(frozen=True)
class ProducerSpec:
    """Everything the producer process needs, picklable: the config sections it reads (no Config object, no
    process group) and how to build its engine and verifier."""

    engine: EngineRecipe
    reward: RewardRecipe
    batch: RLBatchConfig              # rl.batch: prompts per step (the global draw per round), G
    filter: FilterConfig              # rl.filter: dynamic sampling (DAPO)
    rollout: RolloutConfig            # rollout.staleness (N), .partial, .producer_threads, .producer_cpus
    sampling: SamplingParams          # without a generator: the producer makes its own from `seed`
    seed: int                         # the engine's sampling generator (megagspo.rl.rollouts_ahead's ahead seed)
    steps: int                        # rl.steps: no batch k >= steps is produced
    share: DPShare                    # the data-parallel rank it serves

    @property
    def staleness(self) -> int:
        return self.rollout.staleness

    def version_for(self, k: int, floor: int) -> int:
        """The policy version that generates batch k: the oldest the staleness bound allows."""
        return max(k - self.staleness, floor)


@dataclass
class ProducedBatch:
    """Batch `index`, started with weights `version` (partial rollouts: later tokens may be newer, out.version_RL),
    scored; `post` is the producer's state after it; `idle_s` its wait for weights since the batch before."""

    index: int
    version: int
    scored: ScoredRollouts
    post: dict                        # {"next": k + 1, "floor", "dataset": JSON state, "generator": ByteTensor}
    idle_s: float = 0.0

    def state_dict(self) -> dict:
        """The checkpoint form: the rollout batch's (Rollouts.state_dict), its rewards, and what the trainer reads of
        it besides (index, version, dynamic sampling's counts, the reward stats)."""
        state = self.scored.rollouts.state_dict()
        state["tensors"]["rewards_R"] = self.scored.rewards_R
        state["meta"].update({"index": self.index, "version": self.version, "filter": self.scored.filter,
                              "stats": dataclasses.asdict(self.scored.stats)})
        return state

    @classmethod
    def from_state(cls, tensors: dict, meta: dict) -> "ProducedBatch":
        """A batch as `state_dict` wrote it (restored: no producer state after it, no times)."""
        scored = ScoredRollouts(Rollouts.from_state(tensors, meta), tensors["rewards_R"],
                                RewardStats(**meta["stats"]), meta["filter"])
        return cls(meta["index"], meta["version"], scored, post={})


STOPS = {signal.SIGINT, signal.SIGTERM}  # the trainer's to answer (megagspo.checkpoint.signals), never the producer's
FRAME_HEADER = struct.Struct("!Q")       # a results frame: its length in bytes, then the pickled ProducedBatch


class ProducerFailed(RuntimeError):
    """The producer died MAX_RESTARTS + 1 times in a row without handing over a batch; the message names the batch
    and the last exit code (the CLI prints it as one line)."""


def _exit_text(code: Optional[int]) -> str:
    """A process's exit code as a user reads it: `exit code -9 (SIGKILL)`."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def _die_with_parent() -> bool:
    """Linux: the kernel kills the producer when the trainer dies (no orphan keeps generating). False when the
    trainer is gone already (it died before this call, so the kernel's request will never fire)."""
    import multiprocessing

    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = multiprocessing.parent_process()
    return parent is None or os.getppid() == parent.pid


@contextlib.contextmanager
def _stops_blocked():
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
class _TestHooks:
    """The producer's test hooks (module docstring): a trace of its phases, and a hold in one of them."""

    trace: Optional[str] = None
    hold: Optional[str] = None

    @classmethod
    def from_env(cls) -> "_TestHooks":
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


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _send_frame(fd: int, payload: bytes, k: int, hooks: _TestHooks) -> None:
    """Batch k into the results pipe as one frame (blocking writes: a full pipe waits for the trainer)."""
    body = memoryview(payload)
    half = len(body) // 2
    _write_all(fd, memoryview(FRAME_HEADER.pack(len(body))))
    _write_all(fd, body[:half])
    hooks.enter("send", k)
    _write_all(fd, body[half:])


class _Commands:
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


class ArrivingWeights:
    """The producer's side of the weight stream: versions in the order the trainer sent them (a message is
    (version, buckets); None ends the producer). `wait_for` blocks until the version a batch needs is loaded;
    `pending` / `apply` make it the engine's WeightSwitch for partial rollouts (only the newest of the versions
    that arrived together is loaded)."""

    def __init__(self, commands, engine) -> None:
        self.commands, self.engine = commands, engine
        self.version: Optional[int] = None
        self.newest = None                # (version, buckets) received and not loaded
        self.closed = False
        self.idle_s = 0.0                 # time spent waiting for a version (not loading it)

    def _load(self, message) -> None:
        version, buckets = message
        self.engine.update_weights_from_buckets(buckets)
        self.version = version

    def wait_for(self, need: int) -> bool:
        """Load weights until version >= need (the newest already received first); False: the producer is told
        to stop."""
        if self.newest is not None:
            message, self.newest = self.newest, None
            self._load(message)
        while self.version is None or self.version < need:
            t0 = time.perf_counter()
            message = self.commands.get()
            self.idle_s += time.perf_counter() - t0
            if message is None:
                self.closed = True
                return False
            self._load(message)
        return True

    def pending(self) -> bool:
        while not self.closed:
            try:
                message = self.commands.get_nowait()
            except queue.Empty:
                break
            if message is None:
                self.closed = True
                break
            self.newest = message
        return self.newest is not None

    def apply(self, engine) -> int:
        message, self.newest = self.newest, None
        self._load(message)
        return self.version


def producer_main(commands_end, results_end, slots) -> None:
    """The producer process. Its first command is the start (spec, prompts, state); then batches start["next"],
    start["next"] + 1, ... < spec.steps, each with the weights of its version (read from `commands` in order, never
    ahead of need), each sent into a free one of `slots` as a frame on `results_end`."""
    for sig in STOPS:  # blocked since the spawn (ProducerProcess.start): from here on, ignored
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    commands = _Commands(commands_end)
    if not _die_with_parent():
        return
    hooks = _TestHooks.from_env()
    first = commands.get()
    if first is None:  # the trainer ended before it sent the start
        return
    spec, dataset, start = first
    hooks.enter("start", start["next"])
    torch.set_num_threads(spec.rollout.producer_threads)
    if spec.rollout.producer_cpus:
        os.sched_setaffinity(0, spec.rollout.producer_cpus)
    engine = spec.engine.build()
    generator = engine.seeded_generator(spec.seed)
    if start.get("dataset") is not None:
        dataset.load_state_dict(start["dataset"])
    if start.get("generator") is not None and generator is not None:
        generator.set_state(start["generator"])
    weights = ArrivingWeights(commands, engine)
    reward_fn = spec.reward.build()
    # each rank's producer on its own: rounds until its own share is full, scored here (no process group)
    maker = BatchMaker(spec.batch, spec.filter, spec.share, dataset, spec.engine.tokenizer, engine.generate,
                       dataclasses.replace(spec.sampling, generator=generator),
                       lambda texts, answers, stats: score_batch(reward_fn, texts, answers, stats))
    switch = weights if spec.rollout.partial else None
    k, floor = start["next"], start["floor"]
    idle = 0.0
    while k < spec.steps:
        # the weights of batch k (in version order; older ones replayed after a restart); partial: or newer
        hooks.enter("wait", k)
        if not weights.wait_for(spec.version_for(k, floor)):
            return
        idle += weights.idle_s
        weights.idle_s = 0.0
        version = weights.version
        hooks.enter("make", k)
        scored = maker.make(switch)
        post = {"next": k + 1, "floor": floor, "dataset": dataset.state_dict(),
                "generator": None if generator is None else generator.get_state()}
        # by value (plain pickle), not as shared-memory handles: those die with this process, which may end (its
        # last batch made, or killed) before the trainer reads the frame
        payload = pickle.dumps(ProducedBatch(k, version, scored, post, idle))
        t0 = time.perf_counter()
        hooks.enter("idle", k)
        slots.acquire()  # blocks while N batches are sent and not taken
        _send_frame(results_end.fileno(), payload, k, hooks)
        idle = time.perf_counter() - t0  # a full queue or pipe blocks the send: idle too
        k += 1


class _Frames:
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


class _Sender:
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


class ProducerProcess:
    """The trainer's handle on the producer: start it, send weights by version, take batches in order, restart it
    when it died. Keeps every version a batch not yet received may still need (to replay after a restart)."""

    POLL_S = 0.5  # how often a wait for a batch looks at the producer besides its pipe and sentinel
    MAX_RESTARTS = 3  # in a row without a batch received: a producer that fails by itself (its traceback is on
    #                   stderr), not one that was killed, is an error rather than a loop

    def __init__(self, spec: ProducerSpec, dataset: PromptDataset, say: Callable[[str], None] = print) -> None:
        import torch.multiprocessing as tmp

        self.spec, self.dataset, self.say = spec, dataset, say
        self.ctx = tmp.get_context("spawn")
        self.bound = max(spec.staleness, 1)  # batches sent and not taken
        self.proc = None
        self.frames: Optional[_Frames] = None
        self.sender: Optional[_Sender] = None
        self.slots = None
        self.sent: dict = {}         # version -> [bucket dicts] (shared memory), the versions still needed
        self.start_state: dict = {}  # where a (re)started producer continues: the state after the last batch taken
        self.restarts = 0
        self._in_a_row = 0

    # ---- lifetime ----------------------------------------------------------------------------------
    def start(self, state: dict) -> None:
        """(Re)start the producer from `state` ({"next", "floor", "dataset", "generator"}) and replay the kept
        versions it needs."""
        import multiprocessing

        if multiprocessing.current_process().daemon:
            raise RuntimeError("rollout.producer = process: this process is a daemonic multiprocessing child, which "
                               "may not start the producer process; run the trainer from a normal process (the CLI, "
                               "torchrun) or use rollout.producer = thread")
        self.start_state = dict(state)
        commands_r, commands_w = self.ctx.Pipe(duplex=False)
        results_r, results_w = self.ctx.Pipe(duplex=False)
        self.slots = self.ctx.Semaphore(self.bound)
        self.proc = self.ctx.Process(target=producer_main, name="megagspo-rollout-producer",
                                     args=(commands_r, results_w, self.slots))
        with _stops_blocked():
            self.proc.start()
        commands_r.close()  # each end in one process: the producer's death ends both pipes
        results_w.close()
        self.frames, self.sender = _Frames(results_r), _Sender(commands_w)
        self.sender.put((self.spec, self.dataset, self.start_state))
        for version in sorted(self.sent):
            self.sender.put((version, self.sent[version]))

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)  # reaps it
        self.sender.close()
        self.frames.close()
        if self.proc.exitcode is not None:
            self.proc.close()
        self.proc = None

    # ---- weights ------------------------------------------------------------------------------------
    def send_weights(self, version: int, buckets: list) -> None:
        self.sent[version] = buckets
        self.sender.put((version, buckets))

    def _forget_before(self, version: int) -> None:
        for v in [v for v in self.sent if v < version]:
            del self.sent[v]

    # ---- batches ------------------------------------------------------------------------------------
    def depth(self) -> int:
        """Batches sent (or being sent) and not taken."""
        try:
            return self.bound - self.slots.get_value()
        except NotImplementedError:  # macOS
            return -1

    def take(self, index: int) -> ProducedBatch:
        """Batch `index` (the next one in order); restarts the producer from the last batch taken if it died, a
        batch half received included."""
        while True:
            payload = self.frames.receive(self.POLL_S, self.proc.sentinel)
            if payload is None:
                if self.proc.is_alive():
                    if self.frames.ended:  # it closed its end: it is ending
                        self.proc.join(self.POLL_S)
                    continue
                payload = self.frames.receive(0)  # a frame it wrote whole before it ended is still in the pipe
                if payload is None:
                    self._restart()
                    continue
            self.slots.release()
            batch = pickle.loads(payload)
            if batch.index != index:
                raise RuntimeError(f"rollout producer: got batch {batch.index}, expected {index}")
            self.start_state = dict(batch.post)
            self._in_a_row = 0
            self._forget_before(self.spec.version_for(batch.index + 1, batch.post["floor"]))
            return batch

    def _restart(self) -> None:
        code = self.proc.exitcode
        self.close()
        if self._in_a_row >= self.MAX_RESTARTS:
            raise ProducerFailed(f"rollout producer: died {self._in_a_row + 1} times in a row at batch "
                                 f"{self.start_state['next']} (last {_exit_text(code)}"
                                 + ("; its traceback is on stderr)" if code and code > 0 else ")"))
        self.restarts += 1
        self._in_a_row += 1
        self.say(f"rollout producer died ({_exit_text(code)}); restarted at batch {self.start_state['next']} from "
                 "the state after the last batch received (nothing lost or repeated)")
        self.start(self.start_state)
