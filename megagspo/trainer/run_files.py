"""The files of a run folder the Trainer writes besides checkpoints: metrics.jsonl and config.yaml when the run
starts, summary.json and the plots when it ends. Rank 0 writes; a failure reaches every rank."""

from __future__ import annotations

import json
import os

import yaml

from megagspo.checkpoint import CheckpointManager
from megagspo.config import Config
from megagspo.metrics_log import MetricsLogger, rl_start_accuracy, write_plots
from moe.parallel import ParallelDims


def open_run_files(cfg: Config, dims: ParallelDims, ckpt: CheckpointManager, resume) -> MetricsLogger:
    """Everything is checked: from here on the run folder is written. A fresh run first moves earlier
    checkpoints aside; metrics.jsonl (the rows up to a resumed checkpoint) and config.yaml are rewritten.
    -> the run's MetricsLogger (writing on rank 0, disabled elsewhere)."""
    ckpt.retire_previous()
    logger = [MetricsLogger(cfg.run_dir(), enabled=False)]

    def write():
        prior = ckpt.prior_metrics(resume, os.path.join(cfg.run_dir(), "metrics.jsonl")) if resume else []
        logger[0] = MetricsLogger(cfg.run_dir(), enabled=True, tensorboard=cfg.log.tensorboard)
        for row in prior:  # already in tb/ from the process that logged them first
            logger[0].log(row, tensorboard=False)
        logger[0].raise_write_error()
        with open(os.path.join(cfg.run_dir(), "config.yaml"), "w") as f:
            f.write(changes_header((resume or {}).get("config_changes") or []))
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)

    dims.on_rank0("writing metrics.jsonl and config.yaml", write)
    return logger[0]


def changes_header(changes: list) -> str:
    """config.yaml holds the settings in force now; where a resume changed defining ones
    (checkpoint.allow_config_change; megagspo.checkpoint.state.changes_record) its first lines say since when, so
    the file never reads as if the whole run had had them. A YAML comment: readers of the file are unaffected."""
    if not changes:
        return ""
    lines = ["# This run's settings changed on a resume (checkpoint.allow_config_change=true). The values below hold",
             "# since the step named; the RL steps up to it ran with the old value (summary.json: config_changes):"]
    lines += [f"#   {c['key']}: {c['old']!r} up to RL step {c['step']}, {c['new']!r} after it" for c in changes]
    return "\n".join(lines) + "\n"


def write_summary(cfg: Config, summary: dict, rows: list) -> None:
    """Rank 0, at the end: the plots (log.plots) and summary.json."""
    if cfg.log.plots:
        summary["plots"] = write_plots(rows, cfg.run_dir(), rl_start_accuracy(summary), loss=cfg.rl.loss.name,
                                       sampled_measured=bool(cfg.rl.eval.samples),
                                       cold_start_label="cold start" if cfg.sft.steps else "before RL")
    with open(os.path.join(cfg.run_dir(), "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
