"""Reruns never lose a run (megagspo.checkpoint.run_folder):
- a fresh start in a run folder that holds a run is refused, naming --resume and --overwrite, and changes nothing;
- a fresh start over a FINISHED run of the same config (`make train` twice) says so and prints its summary (exit 0);
- --overwrite moves the whole earlier run (metrics, summary, plots, config, TensorBoard events, checkpoints) into one
  sibling folder before anything is written: every file there byte-identical to before, nothing truncated, and the
  run folder then holds only the new run (one TensorBoard event file, its own metrics);
- --resume and --overwrite together are refused."""

import hashlib
import json
import os

import pytest

from helpers import CliRuns
from multiprocess import cpu_pinned_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["sft.steps=1", "sft.batch_size=4", "rl.steps=2", "rl.batch.prompts_per_step=2", "rl.batch.group_size=2",
        "rl.batch.mini_batches=1", "rl.eval.every=1", "rl.eval.samples=0", "data.train_size=50", "data.eval_size=5",
        "log.progress=false", "threads=1"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's two `megagspo train` runs (both only read afterwards): the second costs its
    training, not a fresh start-up."""
    env = cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = CliRuns(env, str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _train(cli, out_dir, *extra):
    return cli.run(["train", "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={out_dir}", "name=r", *extra],
                   timeout=240)


def _snapshot(root):
    """sha256 of every file under root but the lock file (it says who holds the folder; it is not run data)."""
    from megagspo.checkpoint.run_lock import LOCK_FILE

    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name != LOCK_FILE:
                path = os.path.join(dirpath, name)
                out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished(cli, tmp_path_factory):
    """A finished tiny run `r` (plots and TensorBoard on) and the snapshot of its folder."""
    out = tmp_path_factory.mktemp("rerun")
    proc = _train(cli, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out / "r"
    names = set(os.listdir(run_dir))
    # everything a run writes is there, so that moving it aside is tested on all of it
    assert {"metrics.jsonl", "summary.json", "config.yaml", "checkpoints", "checkpoint.pt", "cold_start.pt",
            "reward_accuracy.png", "tb"} <= names, names
    return out, run_dir


def _train_inprocess(capsys, out_dir, *extra):
    """`megagspo train` in this process (what these tests check happens before any model is built)."""
    from megagspo.cli import main

    rc = main(["train", "--config", os.path.join(REPO, "configs/tiny_cpu.yaml"), *TINY, f"log.out_dir={out_dir}",
               "name=r", *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_a_finished_run_of_the_same_config_prints_its_summary_instead_of_starting_over(finished, capsys):
    out, run_dir = finished
    before = _snapshot(run_dir)
    summary = json.load(open(run_dir / "summary.json"))
    rc, stdout, err = _train_inprocess(capsys, out)
    assert rc == 0, err[-3000:]
    assert "already holds a finished run of this config: not starting over" in stdout, stdout
    assert "--overwrite" in stdout
    assert f"final/accuracy                 {summary['final/accuracy']:.3f}" in stdout, stdout
    assert "held-out accuracy" not in stdout  # nothing ran
    assert _snapshot(run_dir) == before
    assert [n for n in os.listdir(out) if "replaced" in n] == []


def test_a_fresh_start_over_a_run_of_another_config_is_refused_and_changes_nothing(finished, capsys):
    out, run_dir = finished
    before = _snapshot(run_dir)
    rc, _, err = _train_inprocess(capsys, out, "seed=3")
    assert rc == 2, err[-3000:]
    assert "already holds a finished run of a different config (seed: 0 there, 3 asked)" in err, err[-3000:]
    assert "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert _snapshot(run_dir) == before
    assert [n for n in os.listdir(out) if "replaced" in n] == []


def test_a_fresh_start_over_an_unfinished_run_is_refused_naming_resume_and_overwrite(tmp_path, capsys):
    """An interrupted run (metrics and a checkpoint folder, no summary.json): in this process, since the
    refusal comes before any model is built."""
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step_000000").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000000" / "trainer_state.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 0.0}) + "\n")
    (run_dir / "tb").mkdir()
    (run_dir / "tb" / "events.out.tfevents.1").write_bytes(b"earlier events")
    before = _snapshot(run_dir)
    rc, _, err = _train_inprocess(capsys, tmp_path, "log.tensorboard=false")
    assert rc == 2, err
    assert "already holds an unfinished run (no summary.json)" in err and "Traceback" not in err, err
    assert "--resume continues it" in err and "--overwrite moves the whole earlier run aside" in err, err
    assert _snapshot(run_dir) == before
    assert sorted(os.listdir(tmp_path)) == ["r"]


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    from megagspo.cli import main

    rc = main(["train", "--config", os.path.join(REPO, "configs/tiny_cpu.yaml"), "--resume", "--overwrite",
               f"log.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume continues the run in the folder and --overwrite moves it aside" in err, err
    assert os.listdir(tmp_path) == []


def test_overwrite_moves_the_whole_earlier_run_aside_as_one_folder_before_writing(cli, finished):
    """Runs last in this module: it replaces the fixture's run."""
    out, run_dir = finished
    before = _snapshot(run_dir)
    old_events = sorted(os.listdir(run_dir / "tb"))
    proc = _train(cli, out, "seed=3", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = [n for n in os.listdir(out) if n.startswith("r.replaced-")]
    assert len(aside) == 1, os.listdir(out)
    assert f"moved whole to {out / aside[0]}" in proc.stdout, proc.stdout
    # every file of the earlier run is in that one folder, byte for byte: nothing truncated, lost or mixed in
    assert _snapshot(out / aside[0]) == before
    # the run folder holds the new run only: its own metrics from row one, one TensorBoard event file, its config
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert rows[0]["phase"] in ("sft", "cold_start") and sum(r["phase"] == "rl" for r in rows) == 2
    new_events = os.listdir(run_dir / "tb")
    assert len(new_events) == 1 and new_events != old_events, (new_events, old_events)
    import yaml

    assert yaml.safe_load(open(run_dir / "config.yaml"))["seed"] == 3
    assert json.load(open(run_dir / "summary.json"))["final/accuracy"] >= 0.0
