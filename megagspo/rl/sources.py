"""Where an RL step's scored rollouts come from: one protocol, one implementation per way of producing them.

    source.next(step)    -> SourcedBatch: this rank's rollouts, their scores, the source's own metrics and times
    source.after_update() -> times: what the source does once the step's update is done (before the weight sync)
    source.holder         -> what a checkpoint saves of the source (a RolloutsAhead), or None

    Synchronous     collect, then score (rollout.staleness 0)
    OneStepAhead    take the batch generated during the previous step, launch the next one (rollout.staleness 1;
                    megagspo.rl.rollouts_ahead)
    GroupFiltered   rounds of collect + rewards until every DP rank holds its share of informative groups
                    (rl.filter.enabled: DAPO's dynamic sampling; megagspo.rl.dynamic_sampling)

`source_class` is the one rule for which source a recipe gets and what combines with what; the preflight that
the trainer and the dry run share applies it, and `build_rollout_source` builds from it. The step never branches
on the rollout mode: a fully asynchronous producer is one more class here.

Legend (docs/architecture.md): B prompts (this rank's share), G samples per prompt, R = B*G responses.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Protocol

import torch

from megagspo.algorithm import group_advantages
from megagspo.config import ConfigError, RLConfig
from megagspo.data.datasets import Example, PromptDataset
from megagspo.data.tokenizer import Tokenizer
from megagspo.policy.engine_link import EngineLink
from megagspo.rewards import RewardStats, score_batch
from megagspo.rl.dynamic_sampling import GroupFilter, merge_stats
from megagspo.rl.rollouts_ahead import RolloutsAhead
from megagspo.rollout import RolloutOutput, SamplingParams
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

    def generate(self, prompts: List[Example]) -> RolloutOutput:
        return self.engine.generate([ex.prompt_ids for ex in prompts], self.rl.batch.group_size, self.sampling)

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
    holder: Optional[RolloutsAhead]

    def next(self, step: int) -> SourcedBatch: ...

    def after_update(self) -> dict: ...


class Synchronous:
    """rollout.staleness 0: each step's batch is generated by the weights after the previous update."""

    holder = None

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
    on a background thread and is waited for after the update, before the weight sync."""

    def __init__(self, collector: RolloutCollector, steps: int, seed: int) -> None:
        self.collector = collector
        self.steps = steps
        # generation on the background thread samples from its own generator, never the global one
        generator = collector.engine.seeded_generator(seed)
        if generator is not None:
            collector.sampling = dataclasses.replace(collector.sampling, generator=generator)
        self.holder = RolloutsAhead(collector.generate, generator)

    def next(self, step: int) -> SourcedBatch:
        t0 = time.perf_counter()
        ahead = self.holder
        rollouts = Rollouts(*ahead.take()) if ahead.holds_batch else self.collector.collect()
        if step + 1 < self.steps:
            ahead.launch(self.collector.draw_prompts())
        return self.collector.scored(rollouts, time.perf_counter() - t0)

    def after_update(self) -> dict:
        return {"time/rollout_wait_s": self.holder.wait()}


class GroupFiltered:
    """rl.filter.enabled (DAPO's dynamic sampling): rounds of collect + rewards until every data-parallel rank holds
    its share of informative groups (reward variance > 0), at most rl.filter.max_rounds."""

    holder = None

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


def source_class(staleness: int, filter_groups: bool, model_parallel: int) -> type:
    """The source a recipe asks for, or a ConfigError naming the keys that cannot combine (the one place)."""
    if staleness and filter_groups:
        raise ConfigError("rollout.staleness = 1 with rl.filter.enabled = true is not supported: dynamic "
                          "sampling draws more rounds after seeing the rewards, which a batch generated ahead "
                          "cannot; set one of them")
    if staleness and model_parallel > 1:
        raise ConfigError("rollout.staleness = 1 needs parallel.tensor_parallel = pipeline_parallel = 1: under "
                          "TP x PP the generating rank broadcasts the rollouts to its peers, a collective that "
                          "cannot run beside the training thread's")
    if staleness:
        return OneStepAhead
    return GroupFiltered if filter_groups else Synchronous


def build_rollout_source(collector: RolloutCollector, staleness: int, ahead_seed: int) -> RolloutSource:
    cls = source_class(staleness, collector.rl.filter.enabled, collector.dims.mp_size)
    if cls is OneStepAhead:
        return OneStepAhead(collector, collector.rl.steps, ahead_seed)
    return cls(collector)
