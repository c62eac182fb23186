"""Held-out evaluation: greedy decoding (and optionally sampled decoding) of the held-out prompts, scored by the
run's reward; a response counts as correct at reward 1. `Evaluator` is built from the process layout, the
rollout engine, the tokenizer, the reward, the held-out examples and the sampling settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megagspo.data.tokenizer import Tokenizer
from megagspo.rewards import RewardStats, score_batch
from megagspo.rollout import RolloutEngine, SamplingParams
from megagspo.rollout.base import response_texts, rollout_function, trajectory_rewards
from moe.parallel import ParallelDims


@dataclass
class Evaluator:
    dims: ParallelDims
    engine: Callable[[], RolloutEngine]  # the engine with the policy's latest weights (EngineLink.current_engine:
    #                                      a collective when it is behind, so every rank calls it first)
    tokenizer: Tokenizer
    reward_fn: Callable              # (response, answer) -> [0, 1]
    held_out: list                   # megagspo.data Examples
    max_response_tokens: int
    samples: int                     # rl.eval.samples: sampled answers per problem (0: greedy only)
    temperature: float
    top_p: float
    agent: Optional[object] = None   # megagspo.agent.AgentRollouts: held-out problems solved with the run's tools

    @torch.no_grad()
    def __call__(self) -> dict:
        """Greedy decoding on the held-out set (split over DP ranks); exact reward as accuracy; sampled accuracy
        only where rl.eval.samples > 0 (the key is absent otherwise). Under TP only
        model-parallel rank 0 decodes and scores (its TP x PP peers hold the same engine weights); its counts
        are shared."""
        engine = self.engine()
        local = self.dims.on_mp_rank0("held-out evaluation", lambda: self._evaluate_local(engine))
        total, correct, lengths, sampled_correct, timeouts = self.dims.dp_sum(local)
        # eval/timeouts: verifier calls cut off at reward.timeout_s (each scored 0): an accuracy they lowered
        # must not read as the model's own
        out = {"eval/accuracy": correct / max(total, 1), "eval/response_length": lengths / max(total, 1),
               "eval/count": total, "eval/timeouts": timeouts}
        if self.samples:  # unmeasured (rl.eval.samples = 0): absent from the rows, never recorded as 0
            out["eval/sampled_accuracy"] = sampled_correct / max(total, 1)
        return out

    def _evaluate_local(self, engine: RolloutEngine) -> list:
        """This data-parallel rank's share: [problems, greedy correct, response tokens, sampled correct, verifier
        time-outs (greedy and sampled)]."""
        examples = self.held_out[self.dims.dp_rank::self.dims.dp_size]
        rollouts = rollout_function(engine.generate, self.agent)
        out = rollouts(examples, 1, SamplingParams(self.max_response_tokens, greedy=True))
        stats = RewardStats()
        scores = trajectory_rewards(out, score_batch(self.reward_fn, response_texts(out, self.tokenizer),
                                                     [ex.answer for ex in examples], stats))
        correct = sum(1.0 for s in scores if s >= 1.0)
        n_s = self.samples
        sampled_correct = 0.0
        if n_s:
            sampled = rollouts(examples, n_s, SamplingParams(self.max_response_tokens, temperature=self.temperature,
                                                             top_p=self.top_p))
            scores_s = trajectory_rewards(sampled, score_batch(self.reward_fn, response_texts(sampled, self.tokenizer),
                                                               [ex.answer for ex in examples for _ in range(n_s)], stats))
            sampled_correct = sum(1.0 for s in scores_s if s >= 1.0) / n_s
        return [float(len(examples)), correct, float(out.sampled_RL.sum()), sampled_correct,
                float(stats.timeouts)]
