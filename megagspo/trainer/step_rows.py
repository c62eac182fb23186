"""The metrics row of each RL step: the step's own metrics, then held-out evaluation every rl.eval.every steps
and after the last step, whose latest result every row carries (`eval/fresh` says whether it was measured at
this step)."""

from __future__ import annotations

import time
from typing import Callable


class StepRows:
    def __init__(self, evaluate: Callable[[], dict], eval_every: int, steps: int, last_eval: dict) -> None:
        """evaluate: () -> held-out metrics (collective); last_eval: the latest before the first row."""
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.steps = steps
        self.last_eval = dict(last_eval)

    def __call__(self, step: int, metrics: dict) -> dict:
        """The row of RL step `step` (0-based) whose step metrics are `metrics`; evaluates when due."""
        row = {"phase": "rl", "step": step}
        row.update(metrics)
        fresh = (step + 1) % self.eval_every == 0 or step == self.steps - 1
        if fresh:
            t = time.perf_counter()
            self.last_eval = self.evaluate()
            row["time/eval_s"] = time.perf_counter() - t
        else:
            row["time/eval_s"] = 0.0
        row.update({k: v for k, v in self.last_eval.items() if k != "eval/count"})
        row["eval/fresh"] = 1.0 if fresh else 0.0
        return row


def bar_postfix(row: dict) -> dict:
    """What a progress bar shows of an RL row."""
    return {"reward": f"{row['reward/mean']:.3f}", "acc": f"{row['eval/accuracy']:.3f}",
            "tok_s": f"{row['throughput/tokens_per_s']:.0f}"}
