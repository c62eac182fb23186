"""Where an RL step's scored rollouts come from: one protocol, one implementation per way of producing them.

    source.next(step)    -> SourcedBatch: this rank's rollouts, their scores, the source's own metrics and times
    source.after_update() -> times: what the source does once the step's update is done (before the weight sync)
    source.holder         -> what a checkpoint saves of the source (state_dict / load_state_dict), or None
    source.syncs_engine   -> True when after_update already gave the engine the new weights (the step's sync skipped)

    Synchronous     collect, then score (rollout.staleness 0)
    OneStepAhead    take the batch generated during the previous step, launch the next one (rollout.staleness 1;
                    megagspo.rl.rollouts_ahead)
    GroupFiltered   rounds of collect + rewards until every DP rank holds its share of informative groups
                    (rl.filter.enabled: DAPO's dynamic sampling; megagspo.rl.dynamic_sampling)
    Produced        a producer process generates and scores batches up to rollout.staleness = N policy versions
                    ahead, dynamic sampling included (rollout.producer = process; megagspo.rl.producer)

`source_class` is the one rule for which source a recipe gets and what combines with what; the preflight that
the trainer and the dry run share applies it, and `build_rollout_source` builds from it. The step never branches
on the rollout mode.

Legend (docs/architecture.md): B prompts (this rank's share), G samples per prompt, R = B*G responses.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Protocol

import torch

from megagspo.algorithm import group_advantages
from megagspo.config import ConfigError, RLConfig, RolloutConfig
from megagspo.data.datasets import Example, PromptDataset
from megagspo.data.tokenizer import Tokenizer
from megagspo.policy.engine_link import EngineLink
from megagspo.rewards import RewardStats, score_batch
from megagspo.rl.dynamic_sampling import GroupFilter, merge_stats
from megagspo.rl.producer import EngineRecipe, ProducedBatch, ProducerProcess, ProducerSpec, RewardRecipe
from megagspo.rl.rollouts_ahead import TENSORS, HandedWeights, RolloutsAhead
from megagspo.rollout import RolloutOutput, SamplingParams
from megagspo.rollout.base import drain
from moe.parallel import ParallelDims


@dataclass
class Rollouts:
    prompts: List[Example]          # this rank's prompts
    out: RolloutOutput              # response_ids_RL, response_mask_RL, logp_RL, routes


@dataclass
class Scores:
    rewards_R: torch.Tensor
    advantages_R: torch.Tensor      # eq. 7, group-normalised
    stats: RewardStats


@dataclass
class SourcedBatch:
    rollouts: Rollouts
    scores: Scores
    metrics: dict = field(default_factory=dict)   # the source's own (filter/*)
    times: dict = field(default_factory=dict)     # time/rollout_s, time/reward_s


class RolloutCollector:
    """What every source does: draw this rank's prompts, sample G responses each, score them (eq. 7)."""

    def __init__(self, dims: ParallelDims, engine: EngineLink, rl: RLConfig, sampling: SamplingParams,
                 tokenizer: Tokenizer, prompts: PromptDataset, reward_fn: Callable[[str, str], float]) -> None:
        self.dims, self.engine, self.rl, self.sampling = dims, engine, rl, sampling
        self.tokenizer, self.prompts, self.reward_fn = tokenizer, prompts, reward_fn

    def draw_prompts(self) -> List[Example]:
        """The next rl.batch.prompts_per_step prompts of the stream (every rank the same draw): this rank's share."""
        return self.dims.local_slice(self.prompts.sample(self.rl.batch.prompts_per_step))

    def generate(self, prompts: List[Example], switch=None) -> RolloutOutput:
        return self.engine.generate([ex.prompt_ids for ex in prompts], self.rl.batch.group_size, self.sampling,
                                    switch=switch)

    def collect(self) -> Rollouts:
        prompts = self.draw_prompts()
        return Rollouts(prompts, self.generate(prompts))

    def rewards(self, rollouts: Rollouts) -> tuple:
        """(rewards_R, RewardStats) of the verifier on the rollouts' responses."""
        out = rollouts.out
        texts = [self.tokenizer.decode(r[m].tolist()) for r, m in zip(out.response_ids_RL, out.response_mask_RL)]
        answers = [ex.answer for ex in rollouts.prompts for _ in range(self.rl.batch.group_size)]
        stats = RewardStats()
        if self.dims.mp_size == 1:
            scores = score_batch(self.reward_fn, texts, answers, stats)
        else:  # the verifier (time-limited, maybe non-deterministic) runs once per TP x PP group: peers agree
            scores, stats = self.dims.on_mp_rank0(
                "reward scoring", lambda: (score_batch(self.reward_fn, texts, answers, stats), stats))
        return torch.tensor(scores, dtype=torch.float32), stats

    def scores_of(self, rewards_R: torch.Tensor, stats: RewardStats) -> Scores:
        advantages_R = group_advantages(rewards_R, group_size=self.rl.batch.group_size,
                                        **dataclasses.asdict(self.rl.advantage))  # eq. 7, rl.advantage
        return Scores(rewards_R, advantages_R, stats)

    def scored(self, rollouts: Rollouts, rollout_s: float) -> SourcedBatch:
        t0 = time.perf_counter()
        rewards_R, stats = self.rewards(rollouts)
        scores = self.scores_of(rewards_R, stats)
        return SourcedBatch(rollouts, scores, times={"time/rollout_s": rollout_s,
                                                     "time/reward_s": time.perf_counter() - t0})


class RolloutSource(Protocol):
    holder: Optional[object]          # RolloutsAhead, Produced: state_dict() / load_state_dict(tensors, meta)
    syncs_engine: bool                # after_update gave the engine the weights after the update itself

    def next(self, step: int) -> SourcedBatch: ...

    def after_update(self) -> dict: ...


class Synchronous:
    """rollout.staleness 0: each step's batch is generated by the weights after the previous update."""

    holder = None
    syncs_engine = False

    def __init__(self, collector: RolloutCollector) -> None:
        self.collector = collector

    def next(self, step: int) -> SourcedBatch:
        t0 = time.perf_counter()
        rollouts = self.collector.collect()
        return self.collector.scored(rollouts, time.perf_counter() - t0)

    def after_update(self) -> dict:
        return {}


class OneStepAhead:
    """rollout.staleness 1: this step's batch was generated during the previous step (or now, when none is held:
    the first step, a resume without one); the next batch's generation starts with the engine's current weights
    on a background thread and is waited for after the update, before the weight sync. With rollout.partial the
    weights after the update go to the generating thread instead (HandedWeights): its unfinished responses
    continue under them, and the engine already holds them when the step ends (`syncs_engine`)."""

    def __init__(self, collector: RolloutCollector, steps: int, seed: int, partial: bool = False) -> None:
        self.collector = collector
        self.steps = steps
        # generation on the background thread samples from its own generator, never the global one
        generator = collector.engine.seeded_generator(seed)
        if generator is not None:
            collector.sampling = dataclasses.replace(collector.sampling, generator=generator)
        self.switch = HandedWeights() if partial else None
        self.syncs_engine = partial
        self.step: Optional[int] = None
        self.holder = RolloutsAhead(functools.partial(collector.generate, switch=self.switch), generator)

    def next(self, step: int) -> SourcedBatch:
        t0 = time.perf_counter()
        ahead = self.holder
        self.step = step
        held = ahead.holds_batch
        rollouts = Rollouts(*ahead.take()) if held else self.collector.collect()
        version = step - 1 if held else step  # a held batch was launched by the step before (or restored)
        if step + 1 < self.steps:
            if self.switch is not None:
                self.switch.version = step  # the engine holds the weights after `step` updates
            ahead.launch(self.collector.draw_prompts())
        sourced = self.collector.scored(rollouts, time.perf_counter() - t0)
        if self.switch is not None:
            sourced.metrics.update(token_staleness(self.collector.dims, rollouts.out, version, step, partial=True))
        return sourced

    def after_update(self) -> dict:
        if self.switch is None:
            return {"time/rollout_wait_s": self.holder.wait()}
        t0 = time.perf_counter()
        link = self.collector.engine
        link.stream_weights(_CopiedWeights(self.step + 1, link.engine.weights_needed, self.switch.hand))
        t1 = time.perf_counter()
        wait_s = self.holder.wait()
        t2 = time.perf_counter()
        if self.switch.pending():  # the batch ahead was done first (or none runs): load them here
            self.switch.apply(link.engine)
        return {"time/rollout_wait_s": wait_s, "time/sync_s": (t1 - t0) + (time.perf_counter() - t2)}


class GroupFiltered:
    """rl.filter.enabled (DAPO's dynamic sampling): rounds of collect + rewards until every data-parallel rank holds
    its share of informative groups (reward variance > 0), at most rl.filter.max_rounds."""

    holder = None
    syncs_engine = False

    def __init__(self, collector: RolloutCollector) -> None:
        self.collector = collector

    def next(self, step: int) -> SourcedBatch:
        c, cfg, dims = self.collector, self.collector.rl, self.collector.dims
        need = len(dims.local_slice(list(range(cfg.batch.prompts_per_step))))
        kept = GroupFilter(need, cfg.batch.group_size)
        stats, rollout_s, reward_s = [], 0.0, 0.0
        while True:
            t0 = time.perf_counter()
            rollouts = c.collect()
            t1 = time.perf_counter()
            rewards_R, round_stats = c.rewards(rollouts)
            reward_s += time.perf_counter() - t1
            rollout_s += t1 - t0
            stats.append(round_stats)
            kept.add_round(rollouts.prompts, rollouts.out, rewards_R)
            ranks_short = dims.dp_sum([float(kept.short > 0)])[0]
            if ranks_short == 0 or kept.rounds >= cfg.filter.max_rounds:
                break
        prompts, out, rewards_R, filled = kept.result(c.tokenizer.pad_id)
        generated, informative, filled_total = dims.dp_sum([float(kept.generated), float(kept.informative),
                                                            float(filled)])
        metrics = {"filter/rounds": float(kept.rounds),
                   "filter/informative_frac": informative / max(generated, 1.0),  # of the groups generated
                   "filter/filled_frac": filled_total / cfg.batch.prompts_per_step}    # of the batch: zero-advantage fill
        return SourcedBatch(Rollouts(prompts, out), c.scores_of(rewards_R, merge_stats(stats)), metrics,
                            {"time/rollout_s": rollout_s, "time/reward_s": reward_s})

    def after_update(self) -> dict:
        return {}


def token_staleness(dims: ParallelDims, out: RolloutOutput, version: int, step: int, partial: bool) -> dict:
    """Staleness of the consumed tokens (versions between the weights that sampled them and this update: `step`),
    each token's version from out.version_RL, else `version` (the batch's). With partial rollouts also how many
    responses were continued under newer weights, and the share of tokens sampled under a version older than their
    response's newest (the tokens an update overtook)."""
    mask_RL = out.response_mask_RL.bool()
    version_RL = out.versions_RL(version)
    stale_RL = (step - version_RL).double().masked_fill(~mask_RL, 0.0)
    newest_R1 = version_RL.masked_fill(~mask_RL, -1).amax(1, keepdim=True) if mask_RL.numel() else version_RL
    overtaken_RL = mask_RL & (version_RL < newest_R1)
    sums = [float(mask_RL.sum()), float(stale_RL.sum()), float(mask_RL[stale_RL > 0].sum()), float(overtaken_RL.sum()),
            float(overtaken_RL.any(1).sum()) if mask_RL.numel() else 0.0, float(mask_RL.shape[0])]
    total, stale_sum, stale_tokens, overtaken, continued, rows = dims.dp_sum(sums)
    most = max(v[0] for v in dims.dp_gather([float(stale_RL.max()) if stale_RL.numel() else 0.0]))
    metrics = {"rollout/staleness_mean": stale_sum / max(total, 1.0), "rollout/staleness_max": most,
               "rollout/stale_token_frac": stale_tokens / max(total, 1.0)}
    if partial:
        metrics.update({"rollout/older_version_token_frac": overtaken / max(total, 1.0),
                        "rollout/continued_response_frac": continued / max(rows, 1.0)})
    return metrics


class Produced:
    """rollout.staleness = N with the producer process (megagspo.rl.producer): batch k was generated with the
    policy version max(k - N, start) by a process of its own, scored there (dynamic sampling's rounds included),
    and waits in a queue of at most N batches. The model-parallel rank 0 of each data-parallel rank talks to its
    producer and shares the batch with its TP x PP peers, as generation does; the weights go to the producer after
    each update, streamed in the engine link's buckets (a collective, on every rank). The source's state (the
    batches received and not consumed, the producer's state after the last of them) is what a checkpoint holds:
    `state_dict` / `load_state_dict`, through `holder`."""

    def __init__(self, collector: RolloutCollector, spec: ProducerSpec) -> None:
        self.collector, self.spec, self.dims = collector, spec, collector.dims
        self.producer = ProducerProcess(spec, collector.prompts) if self.dims.generates else None
        self.holder = self
        self.syncs_engine = False
        self.version: Optional[int] = None     # the policy version the trainer holds; None: not started
        self.held: deque = deque()             # ProducedBatch received (or restored), not yet consumed
        self.next_index = 0                    # the next batch to receive from the producer
        self.resume_state: Optional[dict] = None

    # ---- the protocol ---------------------------------------------------------------------------------------
    def next(self, step: int) -> SourcedBatch:
        if self.version is None:
            self._start(step)
        t0 = time.perf_counter()
        batch, depth = self.dims.on_mp_rank0("rollouts from the producer", lambda: self._take(step))
        wait_s = time.perf_counter() - t0
        c = self.collector
        metrics = token_staleness(self.dims, batch.out, batch.version, step, self.spec.partial)
        if self.spec.filter_groups:
            metrics.update(self._filter_metrics(batch.filter))
        times = {"time/rollout_s": batch.times["rollout_s"], "time/reward_s": batch.times["reward_s"],
                 "time/producer_idle_s": batch.times["idle_s"], "time/trainer_wait_s": wait_s,
                 # the batches ready behind this one when the step asked (at most N); timing-dependent (how far the
                 # producer got), hence among the time/ entries
                 "time/queue_depth": float(depth)}
        return SourcedBatch(Rollouts(batch.prompts, batch.out), c.scores_of(batch.rewards_R, batch.stats),
                            metrics, times)

    def after_update(self) -> dict:
        """Send the weights after this update (version + 1) to the producer, when a batch still to come needs them."""
        self.version += 1
        if self.spec.version_for(self.spec.steps - 1, 0) < self.version:
            return {}
        t0 = time.perf_counter()
        self._send_weights()
        return {"time/producer_sync_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()

    # ---- inside -----------------------------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        """Start the producer where the run is: the restored state, or batch `step` from the current weights and the
        prompt stream's current position (fresh start; a checkpoint that held no producer state)."""
        self.version = step
        state = self.resume_state or {"next": step, "floor": step, "dataset": self.collector.prompts.state_dict(),
                                      "generator": None}
        self.next_index = state["next"]
        if self.producer is not None:
            self.producer.start(state)
        self._send_weights()

    def _send_weights(self) -> None:
        deliver = None if self.producer is None else self.producer.send_weights
        self.collector.engine.stream_weights(_CopiedWeights(self.version, lambda generates: generates, deliver))

    def _receive(self) -> None:
        self.held.append(self.producer.take(self.next_index))
        self.next_index += 1

    def _take(self, step: int):
        ready = len(self.held) + self.producer.depth()
        if not self.held:
            self._receive()
        batch = self.held.popleft()
        depth = max(ready - 1, 0)  # scored batches ready behind this one: at most N (the weights gate the producer)
        if batch.index != step:
            raise RuntimeError(f"rollout producer: step {step} was given batch {batch.index} (a checkpoint of another "
                               "run or rl.steps?)")
        return batch, depth

    def _filter_metrics(self, info: dict) -> dict:
        """As GroupFiltered's: rounds (the most any rank drew), informative groups of those generated, filled share."""
        generated, informative, filled = self.dims.dp_sum([info["generated"], info["informative"], info["filled"]])
        rounds = max(v[0] for v in self.dims.dp_gather([info["rounds"]]))
        return {"filter/rounds": rounds, "filter/informative_frac": informative / max(generated, 1.0),
                "filter/filled_frac": filled / self.spec.prompts_per_step}

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The batches received and not consumed, after waiting for every batch generated with weights older than
        the current ones (a resumed run has only these), and the producer's state after the last of them, as
        {"tensors": {...}, "meta": JSON-able}; None before the producer started and on ranks without one."""
        if self.version is None or self.producer is None:
            return None
        while self.next_index < self.spec.steps and \
                self.spec.version_for(self.next_index, self.producer.start_state["floor"]) < self.version:
            self._receive()
        tensors, batches = {}, []
        for i, b in enumerate(self.held):
            out = b.out
            prefix = f"b{i}/"
            for name in TENSORS:
                if getattr(out, name) is not None:
                    tensors[prefix + name] = getattr(out, name)
            # log-probs only where generated (a checkpoint refuses non-finite padding; every reader masks it)
            tensors[prefix + "logp_RL"] = out.logp_RL.masked_fill(~out.response_mask_RL, 0.0)
            tensors[prefix + "rewards_R"] = b.rewards_R
            batches.append({"index": b.index, "version": b.version, "filter": b.filter,
                            "stats": dataclasses.asdict(b.stats), "prompt_ids": [list(p) for p in out.prompt_ids],
                            "prompts": [{"prompt": ex.prompt, "answer": ex.answer, "prompt_ids": list(ex.prompt_ids)}
                                        for ex in b.prompts]})
        state = dict(self.producer.start_state)
        if state.get("generator") is not None:
            tensors["generator"] = state.pop("generator")
        state.pop("generator", None)
        return {"tensors": tensors, "meta": {"kind": "producer", "batches": batches, "state": state}}

    def load_state_dict(self, tensors: dict, meta: dict) -> None:
        """Hold the checkpoint's batches again; the producer restarts from the state after the last of them."""
        if meta.get("kind") != "producer":
            print("the checkpoint's batch generated ahead comes from rollout.producer = thread: the producer starts "
                  "from the checkpoint's weights (the run continues; it is not a bit-for-bit replay)", flush=True)
            return
        self.held.clear()
        for i, b in enumerate(meta["batches"]):
            prefix = f"b{i}/"
            out = RolloutOutput(prompt_ids=b["prompt_ids"], routes_RPLyK=tensors.get(prefix + "routes_RPLyK"),
                                version_RL=tensors.get(prefix + "version_RL"),
                                **{name: tensors[prefix + name] for name in TENSORS[:3]})
            prompts = [Example(prompt=p["prompt"] if isinstance(p["prompt"], str) else tuple(p["prompt"]),
                               answer=p["answer"], prompt_ids=tuple(p["prompt_ids"])) for p in b["prompts"]]
            self.held.append(ProducedBatch(b["index"], b["version"], prompts, out, tensors[prefix + "rewards_R"],
                                           RewardStats(**b["stats"]), b["filter"], {}, 
                                           {"rollout_s": 0.0, "reward_s": 0.0, "idle_s": 0.0}))
        self.resume_state = dict(meta["state"], generator=tensors.get("generator"))


class _CopiedWeights:
    """The weight stream's consumer for a receiver that loads the weights later, elsewhere (EngineLink.stream_weights):
    the producer process (Produced) or the generating thread (OneStepAhead with partial rollouts). The ranks that
    `needed(generates)` names keep each bucket as a host copy (the trainer's next update overwrites the parameters;
    a GPU beside a running generation may not hold the model twice) and `deliver(version, buckets)` the lot; the
    others, and a rank with nothing to deliver to, only iterate the stream."""

    def __init__(self, version: int, needed: Callable[[bool], bool],
                 deliver: Optional[Callable[[int, list], None]]) -> None:
        self.version, self.needed, self.deliver = version, needed, deliver

    def weights_needed(self, generates: bool) -> bool:
        return self.deliver is not None and self.needed(generates)

    def update_weights_from_buckets(self, buckets) -> None:
        it = iter(buckets)
        if not getattr(buckets, "receive", True) or self.deliver is None:
            drain(it)
            return
        kept = [{name: t.detach().to("cpu", copy=True) for name, t in bucket.items()} for bucket in it]
        self.deliver(self.version, kept)


PRODUCERS = ("auto", "process", "thread")


def producer_kind(producer: str, engine: str) -> str:
    """rollout.producer = auto: a process for the embedded engine (its generation competes with the update for this
    process's cores), the thread for SGLang (a server generates elsewhere; the thread only waits on HTTP)."""
    if producer == "auto":
        return "process" if engine == "hf" else "thread"
    return producer


def source_class(staleness: int, filter_groups: bool, model_parallel: int, producer: str = "auto",
                 engine: str = "hf", partial: bool = False, world: int = 1) -> type:
    """The source a recipe asks for, or a ConfigError naming the keys that cannot combine (the one place)."""
    if not staleness:
        if partial:
            raise ConfigError("rollout.partial = true continues unfinished responses under weights that arrive "
                              "while a batch is generated ahead: it needs rollout.staleness >= 1")
        return GroupFiltered if filter_groups else Synchronous
    kind = producer_kind(producer, engine)
    if kind == "thread" and partial and engine == "sglang" and world > 1:
        raise ConfigError(f"rollout.partial = true with rollout.engine = sglang runs in one trainer process (the "
                          f"generating thread loads the weights into the servers, and under {world} processes that "
                          "load is a collective of every rank); run one process or set rollout.partial = false")
    if kind == "thread":
        if staleness > 1 or filter_groups:
            raise ConfigError(f"rollout.producer = thread runs one batch ahead without dynamic sampling: rollout."
                              f"staleness = {staleness} with rl.filter.enabled = {str(filter_groups).lower()} is "
                              "not supported by it; set rollout.producer = process (rollout.engine = hf)")
        if model_parallel > 1:
            raise ConfigError("rollout.producer = thread needs parallel.tensor_parallel = pipeline_parallel = 1: "
                              "under TP x PP the generating rank broadcasts the rollouts to its peers, a collective "
                              "that cannot run beside the training thread's; set rollout.producer = process")
        return OneStepAhead
    if engine != "hf":
        raise ConfigError(f"rollout.producer = process runs the embedded engine (rollout.engine = hf), not "
                          f"rollout.engine = {engine}; with SGLang use rollout.staleness = 1 and rollout.producer = "
                          "thread (the server generates beside the trainer)")
    return Produced


def build_rollout_source(collector: RolloutCollector, rollout: RolloutConfig, ahead_seed: int,
                         engine: Optional[EngineRecipe] = None, reward: Optional[RewardRecipe] = None) -> RolloutSource:
    """The run's source; `engine` and `reward` say how the producer process builds its engine and verifier."""
    rl = collector.rl  # the rl.* this module reads, all here
    cls = source_class(rollout.staleness, rl.filter.enabled, collector.dims.mp_size, rollout.producer, rollout.engine,
                       rollout.partial, collector.dims.world_size)
    if cls is OneStepAhead:
        return OneStepAhead(collector, rl.steps, ahead_seed, rollout.partial)
    if cls is Produced:
        spec = ProducerSpec(
            engine=engine, reward=reward, sampling=collector.sampling, seed=ahead_seed, staleness=rollout.staleness,
            steps=rl.steps, prompts_per_step=rl.batch.prompts_per_step, group_size=rl.batch.group_size,
            dp_rank=collector.dims.dp_rank, dp_size=collector.dims.dp_size, filter_groups=rl.filter.enabled,
            filter_max_rounds=rl.filter.max_rounds, pad_id=collector.tokenizer.pad_id,
            threads=rollout.producer_threads, cpus=tuple(rollout.producer_cpus), partial=rollout.partial)
        return Produced(collector, spec)
    return cls(collector)
