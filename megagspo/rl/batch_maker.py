"""The one place a rollout batch is made: draw this rank's prompts, generate G samples each, score them, and with
DAPO's dynamic sampling (rl.filter.enabled) draw rounds until the share holds its informative groups. Every
rollout source makes its batches here: the synchronous source in the trainer, the one-step-ahead thread (which
runs the phases apart: draw on the training thread, generate on its own, score when the batch is taken) and the
producer process (megagspo.rl.producer), which has no process group.

What differs between them is injected, never branched on here:
    generate      the rollouts of examples: (examples, n, sampling, switch=) -> RolloutOutput, single-turn
                  (megagspo.rollout.base.single_turn over an engine's generate) or an agent's multi-turn trajectories
                  (megagspo.agent.AgentRollouts); in the trainer through the engine link, which runs it on
                  model-parallel rank 0 and shares the result with its TP x PP peers; in the producer on its own engine
    score         texts, answers, RewardStats -> rewards (in the trainer under TP x PP: once per model-parallel group)
    any_short     whether a round must follow, given this rank's shortfall (in the trainer: any data-parallel rank
                  short, a collective, so every rank draws the same rounds; in the producer: this rank's own)

Legend (docs/architecture.md): B prompts (this rank's share), G samples per prompt, R = B*G responses, L response
length.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from megagspo.algorithm import group_advantages
from megagspo.config_training import FilterConfig, GroupAdvantageConfig, RLBatchConfig
from megagspo.data.datasets import Example, PromptDataset
from megagspo.rewards import RewardStats
from megagspo.rl.dynamic_sampling import GroupFilter, merge_stats
from megagspo.rollout.base import RolloutOutput, SamplingParams, WeightSwitch, response_texts, trajectory_rewards
from moe.parallel import DPShare


@dataclass
class Rollouts:
    """This rank's prompts and the engine's output for them (G responses each, prompt-major)."""

    prompts: List[Example]
    out: RolloutOutput

    def state_dict(self) -> dict:
        """The checkpoint form of a rollout batch: RolloutOutput.state_dict, with the prompts in its meta."""
        state = self.out.state_dict()
        state["meta"]["prompts"] = [{"prompt": ex.prompt, "answer": ex.answer, "prompt_ids": list(ex.prompt_ids)}
                                    for ex in self.prompts]
        return state

    @classmethod
    def from_state(cls, tensors: Dict[str, torch.Tensor], meta: dict) -> "Rollouts":
        prompts = [Example(prompt=p["prompt"] if isinstance(p["prompt"], str) else tuple(p["prompt"]),
                           answer=p["answer"], prompt_ids=tuple(p["prompt_ids"])) for p in meta["prompts"]]
        return cls(prompts, RolloutOutput.from_state(tensors, meta))


@dataclass
class Scores:
    rewards_R: torch.Tensor
    advantages_R: torch.Tensor      # eq. 7, group-normalised
    stats: RewardStats


@dataclass
class ScoredRollouts:
    """A made batch before its advantages: what a producer process sends (advantages are the trainer's, from
    rl.advantage)."""

    rollouts: Rollouts
    rewards_R: torch.Tensor
    stats: RewardStats
    filter: dict = field(default_factory=dict)   # dynamic sampling: rounds / generated / informative / filled
    rollout_s: float = 0.0
    reward_s: float = 0.0


def scores_of(rewards_R: torch.Tensor, stats: RewardStats, group_size: int, advantage: GroupAdvantageConfig) -> Scores:
    """The batch's group-normalised advantages (eq. 7, rl.advantage)."""
    advantages_R = group_advantages(rewards_R, group_size=group_size, **dataclasses.asdict(advantage))
    return Scores(rewards_R, advantages_R, stats)


def filter_metrics(info: dict, prompts_per_step: int, dp_sum: Callable, dp_gather: Callable) -> dict:
    """Dynamic sampling's metrics over the data-parallel ranks (collective): the most rounds any rank drew, the
    informative groups of those generated, the share of the batch filled with zero-advantage groups."""
    generated, informative, filled = dp_sum([info["generated"], info["informative"], info["filled"]])
    rounds = max(v[0] for v in dp_gather([info["rounds"]]))
    return {"filter/rounds": rounds, "filter/informative_frac": informative / max(generated, 1.0),
            "filter/filled_frac": filled / prompts_per_step}


Generate = Callable[..., RolloutOutput]           # (examples, n, sampling, switch=) -> RolloutOutput
Score = Callable[[List[str], List[str], RewardStats], List[float]]


class BatchMaker:
    """draw -> generate -> score, and dynamic sampling's rounds (see the module docstring)."""

    def __init__(self, batch: RLBatchConfig, filter: FilterConfig, share: DPShare, prompts: PromptDataset,
                 tokenizer, generate: Generate, sampling: SamplingParams, score: Score,
                 any_short: Callable[[bool], bool] = bool) -> None:
        self.batch, self.filter, self.share, self.prompts = batch, filter, share, prompts
        self.tokenizer, self._generate, self.sampling, self._score = tokenizer, generate, sampling, score
        self.any_short = any_short

    @property
    def group_size(self) -> int:
        return self.batch.group_size

    @property
    def prompts_per_step(self) -> int:
        return self.batch.prompts_per_step

    def draw(self) -> List[Example]:
        """The next rl.batch.prompts_per_step prompts of the stream (every rank the same draw): this rank's share."""
        return self.share.of(self.prompts.sample(self.batch.prompts_per_step))

    def generate(self, prompts: List[Example], switch: Optional[WeightSwitch] = None) -> Rollouts:
        return Rollouts(prompts, self._generate(prompts, self.batch.group_size, self.sampling, switch=switch))

    def rewards(self, rollouts: Rollouts) -> tuple:
        """(rewards_R, RewardStats) of the verifier on the rollouts' responses."""
        answers = [ex.answer for ex in rollouts.prompts for _ in range(self.batch.group_size)]
        stats = RewardStats()
        scores = self._score(response_texts(rollouts.out, self.tokenizer), answers, stats)
        return torch.tensor(trajectory_rewards(rollouts.out, scores), dtype=torch.float32), stats

    def scored(self, rollouts: Rollouts, rollout_s: float = 0.0) -> ScoredRollouts:
        t0 = time.perf_counter()
        rewards_R, stats = self.rewards(rollouts)
        return ScoredRollouts(rollouts, rewards_R, stats, rollout_s=rollout_s, reward_s=time.perf_counter() - t0)

    def make(self, switch: Optional[WeightSwitch] = None) -> ScoredRollouts:
        """One batch: a round (draw, generate, score); with dynamic sampling, rounds until no rank is short of
        informative groups, at most rl.filter.max_rounds."""
        if not self.filter.enabled:
            t0 = time.perf_counter()
            rollouts = self.generate(self.draw(), switch)
            return self.scored(rollouts, time.perf_counter() - t0)
        kept = GroupFilter(len(self.share.of(list(range(self.batch.prompts_per_step)))), self.batch.group_size)
        stats, rollout_s, reward_s = [], 0.0, 0.0
        while True:
            t0 = time.perf_counter()
            rollouts = self.generate(self.draw(), switch)
            t1 = time.perf_counter()
            rewards_R, round_stats = self.rewards(rollouts)
            reward_s += time.perf_counter() - t1
            rollout_s += t1 - t0
            stats.append(round_stats)
            kept.add_round(rollouts.prompts, rollouts.out, rewards_R)
            if not self.any_short(kept.short > 0) or kept.rounds >= self.filter.max_rounds:
                break
        prompts, out, rewards_R, filled = kept.result(self.tokenizer.pad_id)
        info = {"rounds": float(kept.rounds), "generated": float(kept.generated),
                "informative": float(kept.informative), "filled": float(filled)}
        return ScoredRollouts(Rollouts(prompts, out), rewards_R, merge_stats(stats), info, rollout_s, reward_s)
