"""Issue 49, item 8: the lines and records that said more or less than what happened. The "moved whole" line names
only what was moved; the overrides' warning is grammatical; summary.json holds each held-out evaluation's
verifier time-outs beside its accuracy."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

from helpers import REPO

CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def test_the_moved_whole_line_names_only_what_was_moved(tmp_path):
    """A run stopped during cold-start SFT left metric rows and its config; the line said 'metrics, summary, plots,
    TensorBoard events, checkpoints' whatever was there."""
    from megagspo.checkpoint.state import CheckpointManager
    from megagspo.config import load_config

    cfg = load_config(CONFIG, [f"log.out_dir={tmp_path}", "name=r"])
    run_dir = tmp_path / "r"
    (run_dir / "tb").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"phase": "sft", "step": 0}\n')
    (run_dir / "config.yaml").write_text("seed: 0\n")
    said = []
    manager = CheckpointManager(cfg, SimpleNamespace(rank=0, world_size=1), say=said.append)
    manager._retire_pending = True  # as _fresh() leaves it over an earlier run
    manager.retire_previous()
    aside = [n for n in os.listdir(tmp_path) if n.startswith("r.replaced-")]
    assert len(aside) == 1 and sorted(os.listdir(tmp_path / aside[0])) == ["config.yaml", "metrics.jsonl", "tb"]
    assert said == [f"megagspo checkpoint: a fresh run: the earlier run in {run_dir} (config.yaml, metrics.jsonl, tb/) moved whole to "
                    f"{tmp_path / aside[0]}; nothing was deleted"], said


def test_the_overrides_use_keys_from_before_the_sections():
    from megagspo.config import load_config
    from megagspo.config_moves import MovedKeyWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MovedKeyWarning)
        load_config(CONFIG, ["rl.lr=0.001"])
    message = [str(w.message) for w in caught if issubclass(w.category, MovedKeyWarning)]
    assert len(message) == 1 and message[0].startswith("the overrides use 1 config key(s) from before the rl "
                                                       "sections"), message
    assert "which they should use: rl.lr -> rl.optim.lr" in message[0], message


def test_the_summary_holds_each_evaluations_time_outs():
    from megagspo.metrics_log import eval_record

    row = {"eval/accuracy": 0.25, "eval/sampled_accuracy": 0.5, "eval/timeouts": 3.0, "eval/count": 4}
    assert eval_record("final", row, 0) == {"final/accuracy": 0.25, "final/timeouts": 3}
    assert eval_record("cold_start", row, 2) == {"cold_start/accuracy": 0.25, "cold_start/sampled_accuracy": 0.5,
                                                 "cold_start/timeouts": 3}
