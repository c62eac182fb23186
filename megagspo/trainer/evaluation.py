"""Held-out evaluation: greedy decoding (and optionally sampled decoding) of the held-out prompts, scored by the
run's reward; a response counts as correct at reward 1."""

from __future__ import annotations

import torch


@torch.no_grad()
def evaluate(trainer) -> dict:
    """Greedy decoding on the held-out set (split over DP ranks); exact reward as accuracy. Under TP only
    model-parallel rank 0 decodes and scores (its TP x PP peers hold the same engine weights); its counts
    are shared."""
    if trainer.policy.mp_size > 1:
        local = trainer._from_mp_rank0("held-out evaluation", lambda: _evaluate_local(trainer))
    else:
        local = _evaluate_local(trainer)
    total, correct, lengths, sampled_correct = trainer._all_sum(local)
    return {"eval/accuracy": correct / max(total, 1), "eval/response_length": lengths / max(total, 1),
            "eval/sampled_accuracy": sampled_correct / max(total, 1), "eval/count": total}


def _evaluate_local(trainer) -> list:
    """This data-parallel rank's share: [problems, greedy correct, response tokens, sampled correct]."""
    from megagspo.rewards import RewardStats, score_batch
    from megagspo.rollout import SamplingParams

    examples = trainer.held_out[trainer.dp_rank::trainer.dp]
    out = trainer.engine.generate([ex.prompt_ids for ex in examples], 1,
                                  SamplingParams(trainer.cfg.data.max_response_tokens, greedy=True))
    texts = [trainer.tokenizer.decode(r[m].tolist()) for r, m in zip(out.response_ids_RL, out.response_mask_RL)]
    stats = RewardStats()
    scores = score_batch(trainer.reward_fn, texts, [ex.answer for ex in examples], stats)
    correct = sum(1.0 for s in scores if s >= 1.0)
    n_s = trainer.cfg.rl.eval_samples
    sampled_correct = 0.0
    if n_s:
        sampled = trainer.engine.generate([ex.prompt_ids for ex in examples], n_s,
                                          SamplingParams(trainer.cfg.data.max_response_tokens,
                                                         temperature=trainer.cfg.rollout.temperature,
                                                         top_p=trainer.cfg.rollout.top_p))
        texts_s = [trainer.tokenizer.decode(r[m].tolist())
                   for r, m in zip(sampled.response_ids_RL, sampled.response_mask_RL)]
        scores_s = score_batch(trainer.reward_fn, texts_s, [ex.answer for ex in examples for _ in range(n_s)], stats)
        sampled_correct = sum(1.0 for s in scores_s if s >= 1.0) / n_s
    return [float(len(examples)), correct, float(out.response_mask_RL.sum()), sampled_correct]
