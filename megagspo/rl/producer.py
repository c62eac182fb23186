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

The pipes and the signal mask the process lives under: megagspo.rl.producer_pipes; the trainer's handle on it
(start, weights, batches, restarts): megagspo.rl.producer_process.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megagspo.agent.runner import AgentRollouts
from megagspo.config import RolloutConfig
from megagspo.config_training import FilterConfig, RLBatchConfig
from megagspo.data.tokenizer import Tokenizer
from megagspo.rewards import RewardStats, get_reward, score_batch
from megagspo.rewards.bounded import with_time_limit
from megagspo.rl.batch_maker import BatchMaker, Rollouts, ScoredRollouts
from megagspo.rl.peak_memory import PeakMemory
from megagspo.rl.producer_pipes import STOPS, CommandsEnd, TestHooks, send_frame
from megagspo.rollout import SamplingParams, get_engine_class
from megagspo.rollout.base import rollout_function
from moe.architecture import Qwen3MoeArchitecture
from moe.device import model_device
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
    peak_gib: Optional[float] = None  # the producer's peak memory while it made the batch (None: restored)

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
    commands = CommandsEnd(commands_end)
    if not _die_with_parent():
        return
    hooks = TestHooks.from_env()
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
    agent = AgentRollouts(spec.rollout.agent, spec.engine.tokenizer) if spec.rollout.agent.enabled else None
    maker = BatchMaker(spec.batch, spec.filter, spec.share, dataset, spec.engine.tokenizer,
                       rollout_function(engine.generate, agent),
                       dataclasses.replace(spec.sampling, generator=generator),
                       lambda texts, answers, stats: score_batch(reward_fn, texts, answers, stats))
    switch = weights if spec.rollout.partial else None
    memory = PeakMemory(model_device())  # the engine's device (megagspo.rollout.hf_engine)
    k, floor = start["next"], start["floor"]
    idle = 0.0
    while k < spec.steps:
        memory.start()  # the window: the weights' arrival and the batch's making
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
        payload = pickle.dumps(ProducedBatch(k, version, scored, post, idle, memory.peak_gib()))
        t0 = time.perf_counter()
        hooks.enter("idle", k)
        slots.acquire()  # blocks while N batches are sent and not taken
        send_frame(results_end.fileno(), payload, k, hooks)
        idle = time.perf_counter() - t0  # a full queue or pipe blocks the send: idle too
        k += 1
