"""Issue 49, items 4 and 5: a resume says what it does.

4. --resume with another rollout.staleness, rollout.producer or rollout.partial is refused naming the key, as the
   other run-defining settings are; with checkpoint.allow_config_change=true it continues, and the run's record
   keeps which steps ran with which value (summary.json config_changes, the first lines of config.yaml).
5. --resume of a finished run (rl.steps equal to its last step) prints its summary, as a plain rerun does, and
   rewrites nothing (summary.json kept its total_time_s: before, 21.4 s became 0.0045 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import yaml

from helpers import REPO, CliRuns
from multiprocess import cpu_pinned_env

TINY = ["sft.steps=1", "sft.batch_size=4", "rl.batch.prompts_per_step=2", "rl.batch.group_size=2",
        "rl.batch.mini_batches=1", "rl.eval.every=1", "rl.eval.samples=0", "data.train_size=50", "data.eval_size=5",
        "log.progress=false", "log.plots=false", "log.tensorboard=false", "threads=1", "checkpoint.every_steps=1"]
CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def _args(out_dir, *extra):
    return ["train", "--config", CONFIG, *TINY, f"log.out_dir={out_dir}", "name=r", *extra]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's `megagspo` runs: a run costs its work, not a fresh start-up."""
    env = cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = CliRuns(env, str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _snapshot(root):
    """sha256 of every file under root but the lock file (it names the folder's owner, not run data)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name != ".megagspo.lock":
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[os.path.relpath(os.path.join(dirpath, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(cli, tmp_path_factory):
    """A finished 2-step run (synchronous rollouts), a checkpoint after each step."""
    out = tmp_path_factory.mktemp("finished")
    proc = cli.run(_args(out, "rl.steps=2"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# ------------------------------------------------------------------------------- 4. changed rollout settings
def test_a_resume_with_another_rollout_setting_is_refused_naming_it(finished, tmp_path, capsys):
    from megagspo.cli import main

    shutil.copytree(finished / "r", tmp_path / "r", symlinks=True)
    before = _snapshot(tmp_path)
    rc = main(_args(tmp_path, "--resume", "rl.steps=3", "rollout.staleness=1"))
    err = capsys.readouterr().err
    assert rc == 2 and len(_lines(err)) == 1 and "Traceback" not in err, err
    assert "rollout.staleness: 0 in the checkpoint, 1 now" in err and "checkpoint.allow_config_change=true" in err, err
    assert _snapshot(tmp_path) == before


def test_the_rollout_keys_define_the_run():
    """Compared as what they do: rollout.producer = auto is the process for the embedded engine, and without
    staleness nobody generates ahead (rollout.staleness names that change)."""
    from megagspo.checkpoint.state import defining_changes
    from megagspo.config import load_config

    def changes(before, after):
        return [(k, o, n) for k, o, n, _ in defining_changes(load_config(CONFIG, before).to_dict(),
                                                             load_config(CONFIG, after).to_dict())]

    two = ["rollout.staleness=2"]
    assert changes(two, two + ["rollout.producer=process"]) == []  # auto = process with rollout.engine = hf
    assert changes(["rollout.staleness=1"], ["rollout.staleness=1", "rollout.producer=thread"]) == \
        [("rollout.producer", "auto", "thread")]
    assert changes(two, two + ["rollout.partial=true"]) == [("rollout.partial", False, True)]
    assert changes([], two) == [("rollout.staleness", 0, 2)]
    assert changes([], ["rollout.producer=thread"]) == []  # staleness 0: no producer either way


def test_allowed_changes_are_kept_in_the_runs_record(cli, finished, tmp_path):
    """checkpoint.allow_config_change=true: the run continues; summary.json says that steps 1-2 ran at
    staleness 0 and step 3 at 1, and so do the first lines of config.yaml, which holds the values in force now."""
    shutil.copytree(finished / "r", tmp_path / "r", symlinks=True)
    proc = cli.run(_args(tmp_path, "--resume", "rl.steps=3", "rollout.staleness=1", "rollout.producer=thread",
                         "checkpoint.allow_config_change=true"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing with changed settings (checkpoint.allow_config_change): rollout.staleness: 0 in the " \
           "checkpoint, 1 now" in proc.stdout, proc.stdout
    summary = json.load(open(tmp_path / "r" / "summary.json"))
    assert summary["config_changes"] == [{"step": 2, "key": "rollout.staleness", "old": 0, "new": 1}], summary
    text = open(tmp_path / "r" / "config.yaml").read()
    assert text.startswith("# This run's settings changed on a resume (checkpoint.allow_config_change=true)"), text
    assert "#   rollout.staleness: 0 up to RL step 2, 1 after it\n" in text, text
    assert yaml.safe_load(text)["rollout"]["staleness"] == 1
    state = json.load(open(tmp_path / "r" / "checkpoints" / "step_000003" / "trainer_state.json"))
    assert state["summary"]["config_changes"] == summary["config_changes"]  # a later resume keeps the record


# ------------------------------------------------------------------------------------- 5. a finished run
def test_a_resume_of_a_finished_run_prints_its_summary_and_rewrites_nothing(cli, finished, tmp_path):
    shutil.copytree(finished / "r", tmp_path / "r", symlinks=True)
    before = _snapshot(tmp_path)
    summary = json.load(open(tmp_path / "r" / "summary.json"))
    assert {"init/timeouts", "cold_start/timeouts", "final/timeouts"} <= set(summary)  # item 8
    proc = cli.run(_args(tmp_path, "--resume", "rl.steps=2"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"megagspo train: --resume: {tmp_path / 'r'} holds a finished run: step_000002 is after RL step 2, the " \
           "last of rl.steps = 2; nothing to continue, nothing rewritten" in proc.stdout, proc.stdout
    assert f"total_time_s                   {summary['total_time_s']:.3f}" in proc.stdout, proc.stdout
    assert "held-out accuracy" not in proc.stdout
    assert _snapshot(tmp_path) == before


def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_the_resume(tmp_path):
    """The rule's other side, on the files alone: a summary from before the newest checkpoint (of the shorter run
    this one continued) or none at all means the run has not finished; the resume finishes it."""
    from megagspo.checkpoint.run_folder import RunAlreadyFinished, check_not_finished

    step = tmp_path / "r" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    check_not_finished(str(tmp_path / "r"), str(step), 4, 4)  # no summary.json: the run stopped before it
    (tmp_path / "r" / "summary.json").write_text('{"final/accuracy": 0.5}')
    os.utime(tmp_path / "r" / "summary.json", (1_000_000, 1_000_000))  # written before the checkpoint
    check_not_finished(str(tmp_path / "r"), str(step), 4, 4)
    os.utime(tmp_path / "r" / "summary.json")  # now: after it
    check_not_finished(str(tmp_path / "r"), str(step), 4, 5)  # more steps asked: continues
    with pytest.raises(RunAlreadyFinished) as caught:
        check_not_finished(str(tmp_path / "r"), str(step), 4, 4)
    assert caught.value.summary == {"final/accuracy": 0.5}
