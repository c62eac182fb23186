"""Multi-turn, tool-calling trajectories through real `megagspo train` runs of the tool recipe
(configs/tiny_tools_cpu.yaml, tiny sizes): a run with R3, packing (one trajectory one sequence) and dynamic sampling
over trajectories at N = 0, and the producer process at N = 2; each killed with SIGKILL after two steps and resumed
logs exactly the uninterrupted run's metrics. The single-turn recipe's metrics are held by
tests/test_golden_metrics.py.
"""

from __future__ import annotations

import signal
import sys

import pytest

from helpers import CliRuns
from test_checkpoint_resume import _assert_same_metrics, _env, _rows, _served, _start_and_wait

ARGS = ["--config", "configs/tiny_tools_cpu.yaml", "sft.steps=4", "sft.batch_size=8", "rl.steps=3",
        "rl.batch.prompts_per_step=4", "rl.batch.group_size=2", "rl.batch.mini_batches=1", "rl.eval.every=100",
        "rl.eval.samples=0", "data.train_size=60", "data.eval_size=4", "threads=1", "log.progress=false",
        "log.plots=false", "log.tensorboard=false", "log.save_checkpoint=false", "checkpoint.every_steps=1",
        "reward.name=digit_match",  # partial credit: informative groups from the first step
        "rl.filter.enabled=true", "rl.filter.max_rounds=2"]
SYNCHRONOUS_R3 = ["rl.routing_replay=r3", "rl.batch.packing=true"]
STALE2 = ["rollout.staleness=2"]


def _cmd(out_dir, name, *extra):
    return [sys.executable, "-m", "megagspo.cli", "train", *ARGS, f"log.out_dir={out_dir}", f"name={name}", *extra]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's runs that are only read afterwards: a run costs its training, not a fresh
    start-up. The runs killed with SIGKILL have processes of their own."""
    runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


@pytest.fixture(scope="module", params=["n0_r3_packed", "n2_producer"])
def uninterrupted(request, cli, tmp_path_factory):
    extra = SYNCHRONOUS_R3 if request.param == "n0_r3_packed" else STALE2
    out = tmp_path_factory.mktemp(request.param)
    _served(cli, _cmd(out, "ref", *extra))
    return out / "ref", extra


def test_tool_trajectories_train_and_log_their_metrics(uninterrupted):
    run_dir, _ = uninterrupted
    rl = [r for r in _rows(run_dir) if r.get("phase") == "rl"]
    assert len(rl) == 3
    for row in rl:
        assert row["agent/turns_mean"] >= 1.0 and 0.0 < row["agent/mask1_frac"] <= 1.0
        assert "agent/tool_errors/timeout" in row and "filter/rounds" in row


def test_killed_and_resumed_equals_uninterrupted(cli, tmp_path, uninterrupted):
    run_dir, extra = uninterrupted
    proc = _start_and_wait(_cmd(tmp_path, "k", *extra), tmp_path / "k", min_rl_rows=2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    out = _served(cli, _cmd(tmp_path, "k", *extra, "--resume"))
    assert "resuming from" in out.stdout
    _assert_same_metrics(run_dir, tmp_path / "k")


def test_partial_rollouts_continue_trajectories_under_newer_weights_in_the_producer(cli, tmp_path):
    """The producer at N = 2 with partial rollouts and R3: trajectories whose later turns (or later tokens) were
    sampled by newer weights train as one sequence each; every consumed token is at most N versions old. Which
    tokens switch follows the weights' arrival (timing), so only the bounds are asserted."""
    _served(cli, _cmd(tmp_path, "partial", *STALE2, "rollout.partial=true", "rl.routing_replay=r3", "rl.steps=4",
              "checkpoint.every_steps=0"))
    rl = [r for r in _rows(tmp_path / "partial") if r.get("phase") == "rl"]
    assert len(rl) == 4 and [r["rollout/staleness_max"] <= min(r["step"], 2) for r in rl] == [True] * 4
    for row in rl:
        assert 0.0 <= row["rollout/older_version_token_frac"] <= 1.0 and row["agent/turns_mean"] >= 1.0
