"""An ablation's finished runs, read back from their folders: per cell (arm, or arm x setting) the seeds'
summaries and RL metric rows, and the per-arm numbers the report and the claims use."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from moe.json_files import loads_bounded, read_json

from megagspo.ablation.spec import AblationSpec
from megagspo.config import read_yaml_mapping
from megagspo.config_moves import move_old_keys
from megagspo.metrics_log import rl_start_accuracy


def mean_std(values: List[float]) -> Tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


@dataclass
class CellResult:
    arm: str
    seed: int
    config: dict
    summary: dict
    rl_rows: List[dict]
    cold_start_accuracy: float


@dataclass
class ArmResult:
    name: str                  # the cell: "<arm>" or "<setting>/<arm>"
    config: dict
    cells: List[CellResult] = field(default_factory=list)
    arm: str = ""              # the arm's own name ("" = name)
    setting: str = ""          # "" without settings

    @property
    def role(self) -> str:
        """What the claims compare: the loss family (gspo | grpo | other) and the replay, e.g. "grpo_r3"."""
        rl = self.config["rl"]
        family = {"gspo": "gspo", "gspo_token": "gspo", "grpo": "grpo"}.get(rl["loss"]["name"], "other")
        return family if rl["routing_replay"] == "none" else f"{family}_{rl['routing_replay']}"

    @property
    def updates_per_batch(self) -> int:
        """The off-policy degree the Qwen team's claim is about: optimizer updates per rollout batch."""
        return int(self.config["rl"]["batch"]["mini_batches"])

    def label(self) -> str:
        rl = self.config["rl"]
        replay = "" if rl["routing_replay"] == "none" else f" + {rl['routing_replay'].upper()} replay"
        loss = rl["loss"]
        return f"{self.name} ({loss['name']}{replay}, clip {loss['clip_low']:g}/{loss['clip_high']:g})"


def _read_rows(path: str) -> List[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(loads_bounded(line, path))
    return rows


def load_results(spec: AblationSpec) -> Tuple[Dict[str, ArmResult], List[str]]:
    """Finished runs of every cell. -> ({cell: ArmResult}, [folders that are missing or unfinished])."""
    arms: Dict[str, ArmResult] = {}
    missing = []
    for name in spec.cells():
        arm, setting = spec.split_cell(name)
        for seed in spec.seeds:
            run_dir = spec.cell_dir(name, seed)
            paths = [os.path.join(run_dir, n) for n in ("summary.json", "metrics.jsonl", "config.yaml")]
            if not all(os.path.isfile(p) for p in paths):
                missing.append(run_dir)
                continue
            summary = read_json(paths[0])
            rows = _read_rows(paths[1])
            # the recipe reader (size, depth, duplicate keys); a run written before the rl sections under the new names
            config = move_old_keys(read_yaml_mapping(paths[2], "run config"), paths[2])
            rl = [r for r in rows if r.get("phase") == "rl"]
            if not rl or "final/accuracy" not in summary:
                missing.append(run_dir)
                continue
            cell = CellResult(name, seed, config, summary, rl, rl_start_accuracy(summary))
            arms.setdefault(name, ArmResult(name, config, arm=arm, setting=setting)).cells.append(cell)
    return arms, missing


def _tail_mean(cell: CellResult, key: str, frac: float = 0.2) -> float:
    vals = [r[key] for r in cell.rl_rows]
    k = max(1, int(round(len(vals) * frac)))
    return sum(vals[-k:]) / k


def _all_mean(cell: CellResult, key: str) -> float:
    vals = [r[key] for r in cell.rl_rows]
    return sum(vals) / len(vals)


# per-cell (one seed) numbers; arm_table aggregates them over seeds
CELL_METRICS = {
    "cold_start_acc": lambda c: c.cold_start_accuracy,
    "final_acc": lambda c: float(c.summary["final/accuracy"]),
    "delta_acc": lambda c: float(c.summary["final/accuracy"]) - c.cold_start_accuracy,
    "final_sampled_acc": lambda c: float(c.summary.get("final/sampled_accuracy", float("nan"))),
    "reward_tail": lambda c: _tail_mean(c, "reward/mean"),
    "reward_mean": lambda c: _all_mean(c, "reward/mean"),
    "tok_clip": lambda c: _all_mean(c, "clip/tok_frac"),
    "seq_clip": lambda c: _all_mean(c, "clip/seq_frac"),
    "volatility": lambda c: _all_mean(c, "moe/expert_volatility"),
    "kl": lambda c: _all_mean(c, "kl/approx_old"),
    "step_s": lambda c: _all_mean(c, "time/step_s"),
    "rl_time_s": lambda c: float(c.summary.get("rl/time_s", float("nan"))),
}


def per_seed(arm: ArmResult, metric: str) -> Dict[int, float]:
    return {c.seed: float(CELL_METRICS[metric](c)) for c in arm.cells}


def arm_table(arm: ArmResult) -> Dict[str, Tuple[float, float]]:
    """Per-arm final numbers as (mean, std over seeds)."""
    return {key: mean_std([fn(c) for c in arm.cells]) for key, fn in CELL_METRICS.items()}


def finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
