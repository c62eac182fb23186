"""What a user sees: per-step metrics as JSONL (+ TensorBoard when installed), PNG plots at the end.

Only rank 0 writes. Every logged value must be a finite number: a NaN/inf is replaced by nothing — it
raises, naming the key, because a silent NaN in metrics hides a broken run.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.rows: list = []
        self.tb = None
        self.tb_note = ""
        self.write_error: Optional[OSError] = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            open(self.path, "w").close()
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
                except ImportError:
                    self.tb_note = "tensorboard not installed: TensorBoard logging off (metrics.jsonl has everything)"

    def log(self, row: dict) -> None:
        clean = {}
        for key, value in row.items():
            if isinstance(value, str):
                clean[key] = value
                continue
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"metric {key!r} is {value} at step {row.get('step')}")
            clean[key] = value
        self.rows.append(clean)
        if not self.enabled or self.write_error is not None:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(clean) + "\n")
        except OSError as exc:  # kept, and raised at the next step boundary on every rank (raise_write_error)
            self.write_error = exc
            return
        if self.tb is not None:
            step = int(clean.get("step", len(self.rows)))
            for key, value in clean.items():
                if not isinstance(value, str) and key != "step":
                    self.tb.add_scalar(key, value, step)

    def state_dict(self, tail: int) -> dict:
        """How many rows were logged, and the last `tail` of them (restores metrics.jsonl if it is lost)."""
        return {"count": len(self.rows), "rows": self.rows[-tail:] if tail else []}

    def raise_write_error(self) -> None:
        """Raise the OSError that stopped metrics.jsonl from being appended to, if one did."""
        if self.write_error is not None:
            raise self.write_error

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def write_plots(rows: list, run_dir: str, cold_start_acc: Optional[float] = None) -> list:
    """reward / accuracy, clip fraction, expert volatility (+ grad norm, length) -> PNGs in run_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = [r for r in rows if r.get("phase") == "rl"]
    if not rl:
        return []
    steps = [r["step"] for r in rl]
    written = []

    def save(fig, name):
        path = os.path.join(run_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward/mean"] for r in rl], label="train reward (sampled, T=1)", alpha=0.7)
    ev = [(r["step"], r["eval/accuracy"]) for r in rl if r.get("eval/fresh", 0) > 0]
    if ev:
        ax.plot([s for s, _ in ev], [a for _, a in ev], "o-", label="held-out accuracy (greedy)")
        ax.plot([r["step"] for r in rl if r.get("eval/fresh", 0) > 0],
                [r.get("eval/sampled_accuracy", 0.0) for r in rl if r.get("eval/fresh", 0) > 0], "s-",
                label="held-out accuracy (sampled, T=1)")
    if cold_start_acc is not None:
        ax.axhline(cold_start_acc, ls="--", c="gray", label=f"cold start {cold_start_acc:.3f}")
    ax.set_xlabel("RL step"), ax.set_ylabel("reward / accuracy"), ax.legend(), ax.set_ylim(0, 1)
    ax.set_title("GSPO: reward and held-out accuracy")
    save(fig, "reward_accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["clip/seq_frac"] for r in rl], label="sequences clipped")
    ax.plot(steps, [r["clip/tok_frac"] for r in rl], label="tokens clipped", alpha=0.7)
    ax.set_xlabel("RL step"), ax.set_ylabel("fraction"), ax.legend(), ax.set_title("clip fraction")
    save(fig, "clip_fraction.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["moe/expert_volatility"] for r in rl])
    ax.set_xlabel("RL step"), ax.set_ylabel("fraction of top-k choices changed")
    ax.set_title("expert-activation volatility (pi_theta vs pi_old, same tokens)")
    save(fig, "expert_volatility.png")
    return written
