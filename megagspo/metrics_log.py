"""What a user sees: per-step metrics as JSONL (+ TensorBoard when installed), PNG plots and the held-out
accuracy lines at the end (a value that was not measured is said to be so, never shown as 0.000).

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

    def log(self, row: dict, tensorboard: bool = True) -> None:
        """Append one row to metrics.jsonl and, where `tensorboard`, to the TensorBoard events. A resumed run
        re-writes the rows up to its checkpoint with tensorboard=False: the earlier process's event file in
        tb/ holds them already, and logging them again would draw every point twice."""
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
        if self.tb is not None and tensorboard:
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


# ------------------------------------------------------------------------- what the run prints at the end
def eval_record(prefix: str, row: dict, eval_samples: int) -> dict:
    """summary.json entries of one held-out evaluation: sampled accuracy only where it was measured
    (rl.eval.samples > 0), so that an absent value is never recorded as 0; the verifier calls cut off at
    reward.timeout_s (each scored 0), so that an accuracy they lowered is not read as the model's."""
    out = {f"{prefix}/accuracy": row["eval/accuracy"], f"{prefix}/timeouts": int(row.get("eval/timeouts", 0))}
    if eval_samples:
        out[f"{prefix}/sampled_accuracy"] = row["eval/sampled_accuracy"]
    return out


def rl_start_accuracy(summary: dict) -> float:
    """Held-out accuracy where RL started: after the cold-start SFT (cold_start/accuracy), or the initial one when
    no SFT ran (sft.steps = 0: summary.json then names no cold start, only init/accuracy)."""
    return float(summary.get("cold_start/accuracy", summary.get("init/accuracy", float("nan"))))


def timeouts_note(*measured) -> str:
    """'' when no verifier call of these held-out evaluations was cut off at reward.timeout_s; else what a line
    adds, so that an accuracy lowered by time-outs (each scores 0) is not read as the model's own.
    measured: (label, evaluation) pairs, e.g. ("after cold-start SFT", cold)."""
    cut = [(label, int(ev.get("eval/timeouts", 0))) for label, ev in measured if ev.get("eval/timeouts")]
    if not cut:
        return ""
    if len(measured) == 1:
        n = cut[0][1]
        return f"; {n} verifier call{'s' if n != 1 else ''} timed out at reward.timeout_s and scored 0 (eval/timeouts)"
    return ("; verifier calls that timed out at reward.timeout_s and scored 0 (eval/timeouts): "
            + ", ".join(f"{n} {label}" for label, n in cut))


def cold_start_line(initial: dict, cold: dict, sft_steps: int) -> str:
    """The held-out accuracy before RL; without cold-start SFT there is one measurement, said as such."""
    count = int(cold["eval/count"])
    if not sft_steps:
        return (f"held-out accuracy: {cold['eval/accuracy']:.3f} before RL ({count} problems, greedy); "
                "no cold-start SFT (sft.steps=0)" + timeouts_note(("before RL", cold)))
    return (f"held-out accuracy: initial {initial['eval/accuracy']:.3f}, after cold-start SFT "
            f"{cold['eval/accuracy']:.3f} ({count} problems, greedy)"
            + timeouts_note(("initially", initial), ("after cold-start SFT", cold)))


def final_line(final: dict, cold: dict, rl_steps: int, loss: str, sft_steps: int, eval_samples: int,
               temperature: float) -> str:
    """The held-out accuracy after RL against its start; sampled accuracy only where it was measured."""
    start = "cold start" if sft_steps else "before RL"
    line = (f"held-out accuracy after {rl_steps} {loss} steps: greedy {final['eval/accuracy']:.3f} "
            f"({start} {cold['eval/accuracy']:.3f}), ")
    if not eval_samples:
        return line + "sampled: not measured (rl.eval.samples=0)" + timeouts_note(("after RL", final))
    return line + (f"sampled T={temperature:g} {final['eval/sampled_accuracy']:.3f} "
                   f"({start} {cold['eval/sampled_accuracy']:.3f})") + timeouts_note(("after RL", final))


# ---------------------------------------------------------------------------------------------- plots
def smooth(values: list, window: int) -> list:
    """Trailing moving average (the first points average what there is so far): the trend of a noisy curve."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    """About 1/20 of the curve, at least 1 (no smoothing for very short runs)."""
    return max(1, n // 20)


def clip_series(rl_rows: list, loss: str) -> list:
    """[(label, values)] for the clip plot. The low side (A < 0, ratio < 1 - clip_low) and the high side (A > 0,
    ratio > 1 + clip_high) are separate lines; GSPO clips whole sequences, so its clipped-token fraction is
    the same event as its clipped sequences and is not drawn again; token-level ratios (GRPO, GSPO-token) add
    the fraction of tokens clipped."""
    out = [("sequences clipped low (A < 0, ratio < 1 - clip_low)", [r["clip/seq_low_frac"] for r in rl_rows]),
           ("sequences clipped high (A > 0, ratio > 1 + clip_high)", [r["clip/seq_high_frac"] for r in rl_rows])]
    if loss != "gspo":
        out.append(("tokens clipped (low + high)", [r["clip/tok_frac"] for r in rl_rows]))
    return out


def _raw_and_smoothed(ax, steps: list, values: list, label: str, color: str) -> None:
    """The raw values faint behind, their moving average on top (the legend names the window)."""
    window = smoothing_window(len(values))
    if window == 1:
        ax.plot(steps, values, color=color, label=label)
        return
    ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
    ax.plot(steps, smooth(values, window), color=color, label=f"{label}, mean of {window} steps")


def write_plots(rows: list, run_dir: str, cold_start_acc: Optional[float] = None, *, loss: str = "gspo",
                sampled_measured: bool = True, cold_start_label: str = "cold start") -> list:
    """reward / accuracy, clip fractions, expert volatility -> PNGs in run_dir. Noisy per-step curves are drawn
    raw (faint) and smoothed; sampled held-out accuracy only where it was measured (rl.eval.samples > 0)."""
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
    _raw_and_smoothed(ax, steps, [r["reward/mean"] for r in rl], "train reward (sampled, T=1)", "C0")
    fresh = [r for r in rl if r.get("eval/fresh", 0) > 0]
    if fresh:
        ax.plot([r["step"] for r in fresh], [r["eval/accuracy"] for r in fresh], "o-", color="C1",
                label="held-out accuracy (greedy)")
        if sampled_measured:
            ax.plot([r["step"] for r in fresh], [r["eval/sampled_accuracy"] for r in fresh], "s-", color="C2",
                    label="held-out accuracy (sampled, T=1)")
    if cold_start_acc is not None:
        ax.axhline(cold_start_acc, ls="--", c="gray", label=f"{cold_start_label} {cold_start_acc:.3f}")
    ax.set_xlabel("RL step"), ax.set_ylabel("reward / accuracy"), ax.legend(fontsize=8), ax.set_ylim(0, 1)
    ax.set_title(f"{loss.upper()}: reward and held-out accuracy")
    save(fig, "reward_accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, values) in enumerate(clip_series(rl, loss)):
        _raw_and_smoothed(ax, steps, values, label, f"C{i}")
    ax.set_xlabel("RL step"), ax.set_ylabel("fraction"), ax.legend(fontsize=8)
    ax.set_title(f"clipped fraction ({loss})")
    save(fig, "clip_fraction.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    _raw_and_smoothed(ax, steps, [r["moe/expert_volatility"] for r in rl], "top-k choices changed", "C0")
    ax.set_xlabel("RL step"), ax.set_ylabel("fraction of top-k choices changed"), ax.legend(fontsize=8)
    ax.set_title("expert-activation volatility (pi_theta vs pi_old, same tokens)")
    save(fig, "expert_volatility.png")
    return written
