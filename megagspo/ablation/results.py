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


# Engine precisions that differ from the CPU trainer's fp32 (rollout.engine_dtype; auto = fp32 on the CPU)
STRESS_ENGINE_DTYPES = ("bf16", "fp16", "fp8_sim")


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
    def engine_dtype(self) -> str:
        """The rollout engine's precision (rollout.engine_dtype; "auto" for runs written before the dial)."""
        return str(self.config.get("rollout", {}).get("engine_dtype", "auto"))

    @property
    def stress_engine(self) -> bool:
        """True when the engine computes in another precision than the fp32 CPU trainer (bf16 | fp16 | fp8_sim):
        the engine-trainer gap the R3 paper's and Qwen's mechanism claims are about."""
        return self.engine_dtype in STRESS_ENGINE_DTYPES

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


def _opt_mean(cell: CellResult, key: str) -> float:
    """Mean over the RL steps that log `key` (the mismatch metrics: not in runs written before them, and absent
    where nothing is measured); nan when none does."""
    vals = [r[key] for r in cell.rl_rows if key in r and r[key] is not None]
    return sum(vals) / len(vals) if vals else float("nan")


# The engine-trainer mismatch metrics per step (docs/metrics: loss tokens only), as the report's columns
MISMATCH_METRICS = {
    "route_pair": "mismatch/route_pair_frac",         # (token, layer) top-k sets that differ, engine vs pi_old
    "route_token": "mismatch/route_token_frac",       # tokens with such a difference in at least one layer
    "k3_kl": "mismatch/k3_kl",                        # k3 KL between the engine's and pi_old's token log-probs
    "f2": "mismatch/frac_over_ln2",                   # F(tau=2): tokens whose probability ratio is beyond 2
    "f5": "mismatch/frac_over_ln5",                   # F(tau=5)
    "abs_log_ratio": "mismatch/abs_log_ratio",        # mean |delta logp|
    "mult_err": "mismatch/token_mult_prob_error",     # mean exp|delta logp| (NeMo-RL's gate)
    "is_ess": "mismatch/is_ess_frac",                 # effective sample size of the token IS weights / tokens
    "override": "replay/route_override_pair_frac",    # R2 / R3: replayed routes that differ from the live router
}


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
    **{name: (lambda key: lambda c: _opt_mean(c, key))(key) for name, key in MISMATCH_METRICS.items()},
}


def per_seed(arm: ArmResult, metric: str) -> Dict[int, float]:
    return {c.seed: float(CELL_METRICS[metric](c)) for c in arm.cells}


def arm_table(arm: ArmResult) -> Dict[str, Tuple[float, float]]:
    """Per-arm final numbers as (mean, std over seeds); a metric no seed logged is (nan, nan)."""
    out = {}
    for key, fn in CELL_METRICS.items():
        vals = [v for v in (float(fn(c)) for c in arm.cells) if not math.isnan(v)]
        out[key] = mean_std(vals) if vals else (float("nan"), float("nan"))
    return out


def finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
