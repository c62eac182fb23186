"""Issue 49, item 6: `megagspo ablate` on SIGINT or SIGTERM passes the stop on to its running runs (once each: a
trainer's second signal exits without its checkpoint), waits for them, and exits 128 + signal with one line naming
what to rerun; a rerun resumes every interrupted run; a report written while runs are missing or failed names them
at its top. Before: SIGTERM ended the runner silently and left the running cell going, unsupervised; an immediate
rerun then failed that cell as "in use" and wrote a report that did not say so.

The runs here are stand-ins for `megagspo train` (FAKE_RUN: a trainer's signal handling, its "received" line, a
step's pause and its exit code), so that the runner's own behaviour is tested in seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO
from multiprocess import cpu_pinned_env
from test_ablation import _fake_cell, _write_recipe

# argv: the run's megagspo arguments. FAKE_RUN=finish: writes a summary and exits 0; else waits for a signal, then
# (as megagspo.checkpoint.signals) says it, finishes its "step", checkpoints, exits 128 + signal; a second signal
# exits at once. Every signal it gets is counted in <run>/signals.txt.
FAKE_RUN = r"""
import json, os, signal, sys, time
opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("-"))
run_dir = os.path.join(opts["log.out_dir"], opts["name"])
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(run_dir, "argv.json"), "w") as f:
    json.dump(sys.argv[1:], f)
got = []

def handle(signum, frame):
    got.append(signum)
    with open(os.path.join(run_dir, "signals.txt"), "a") as f:
        f.write(f"{signum}\n")
    if len(got) > 1:
        os._exit(128 + signum)
    print(f"megagspo: received {signal.Signals(signum).name}: finishing the current step", flush=True)

signal.signal(signal.SIGTERM, handle)
signal.signal(signal.SIGINT, handle)
if os.environ.get("FAKE_RUN") == "finish":
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"cold_start/accuracy": 0.5, "final/accuracy": 0.5}, f)
    sys.exit(0)
with open(os.path.join(run_dir, "started"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.time() + 180  # a stand-in never outlives a failed test by more than this
while not got and time.time() < deadline:
    time.sleep(0.02)
if not got:
    sys.exit(1)
time.sleep(0.3)  # the step's end, then the checkpoint
open(os.path.join(run_dir, "checkpointed"), "w").close()
sys.exit(128 + got[0])
"""


def _fake_runs(monkeypatch, mode="wait"):
    """The runner starts FAKE_RUN with the run's arguments in place of `python -m megagspo.cli`."""
    from megagspo.ablation import runner

    real = subprocess.Popen
    monkeypatch.setenv("FAKE_RUN", mode)

    def popen(cmd, **kw):
        assert cmd[1:3] == ["-m", "megagspo.cli"], cmd
        return real([sys.executable, "-c", FAKE_RUN, *cmd[3:]], **kw)

    monkeypatch.setattr(runner.subprocess, "Popen", popen)


def _signal_when_started(run_dir, pids, signum, timeout=60):
    """A thread: once the run in run_dir has started, `signum` to each of pids (the runner; a scheduler: the run too)."""
    def go():
        deadline = time.monotonic() + timeout
        started = os.path.join(run_dir, "started")
        while not (os.path.exists(started) and os.path.getsize(started)) and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in pids():
            os.kill(pid, signum)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("who", ["runner", "runner and run"])
def test_a_stop_reaches_each_running_run_once_and_the_runner_waits_for_it(tmp_path, monkeypatch, who):
    """SIGTERM to the runner alone (a `kill`, a terminal's Ctrl-C: the runs have their own sessions), or to the
    runner and the run both (a scheduler signalling every process): the run gets exactly one signal, finishes and
    checkpoints before the runner returns."""
    from megagspo.ablation import load_ablation
    from megagspo.ablation.runner import AblationRunner, AblationStopped

    _fake_runs(monkeypatch)
    spec = load_ablation(_write_recipe(tmp_path, seeds=[0]), out_dir=str(tmp_path / "out"))
    cold = spec.cold_start_dir(0)
    said = []
    runner = AblationRunner(spec, [], jobs=1, say=said.append)

    def pids():  # the "scheduler" signals the run too: FAKE_RUN wrote its pid into its "started" file
        return [os.getpid()] + ([int(open(os.path.join(cold, "started")).read())] if who != "runner" else [])

    _signal_when_started(cold, pids, signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(AblationStopped) as caught:
        runner.run()
    took = time.monotonic() - t0
    stop = caught.value
    assert stop.exit_code == 143 and [r.label for r in stop.stopped] == ["cold_start seed 0"], said
    assert open(os.path.join(cold, "signals.txt")).read().split() == [str(int(signal.SIGTERM))]
    assert os.path.exists(os.path.join(cold, "checkpointed")) and took < 30, (took, said)
    assert len(stop.not_started) == len(spec.cells()) and not stop.failed
    assert stop.line("megagspo ablate --config x.yaml") == (
        f"stopped by SIGTERM: 1 running run(s) stopped at a checkpoint (cold_start seed 0); {len(spec.cells())} not "
        "started; no report written; rerun megagspo ablate --config x.yaml to resume them")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the runner gave the handlers back


def test_the_cli_stops_in_one_line_with_128_plus_signal(tmp_path):
    """`megagspo ablate` itself, SIGINT to its process only (the runs have their own sessions, so this is what a
    terminal's Ctrl-C does too): exit 130, one line on stderr naming the command to rerun; the run checkpointed."""
    recipe = _write_recipe(tmp_path, seeds=[0])
    out = tmp_path / "out"
    script = f"""
import os, signal, subprocess, sys, threading, time
sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
import test_ablate_stop as t
real = subprocess.Popen
os.environ["FAKE_RUN"] = "wait"
def popen(cmd, **kw):
    return real([sys.executable, "-c", t.FAKE_RUN, *cmd[3:]], **kw)
subprocess.Popen = popen
t._signal_when_started({str(out / 'cold_start' / 'seed0')!r}, lambda: [os.getpid()], signal.SIGINT)
from megagspo.cli import main
sys.exit(main(["ablate", "--config", {recipe!r}, "--out", {str(out)!r}, "rl.steps=3"]))
"""
    env = cpu_pinned_env(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 130, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("megagspo ablate: stopped by SIGINT: 1 running run(s) stopped at a checkpoint "
                               "(cold_start seed 0)"), lines[0]
    assert lines[0].endswith(f"rerun megagspo ablate --config {recipe} --out {out} rl.steps=3 to resume them"), lines
    assert open(out / "cold_start" / "seed0" / "signals.txt").read().split() == [str(int(signal.SIGINT))]
    assert not (out / "report.md").exists()


def test_a_rerun_resumes_every_interrupted_run(tmp_path, monkeypatch):
    """A cell stopped part-way (its config, no summary) runs again with checkpoint.resume=auto (its newest
    checkpoint, or afresh if it had none); an interrupted cold start (SFT has no mid-way checkpoint) is redone with
    --overwrite, its attempt moved aside."""
    import yaml

    from megagspo.ablation import load_ablation
    from megagspo.ablation.runner import AblationRunner

    _fake_runs(monkeypatch, "finish")
    spec = load_ablation(_write_recipe(tmp_path, seeds=[0]), out_dir=str(tmp_path / "out"))
    arm = spec.cells()[0]
    for run_dir, cfg in ((spec.cold_start_dir(0), spec.cold_start_config(0, [])),
                         (spec.cell_dir(arm, 0), spec.cell_config(arm, 0, []))):
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg.to_dict(), f)
    said = []
    assert AblationRunner(spec, [], jobs=1, say=said.append).run() == []
    assert f"[ablation] {arm} seed 0: resuming an interrupted run in {spec.cell_dir(arm, 0)}" in said, said
    assert any(line.startswith("[ablation] cold_start seed 0: an interrupted cold start") for line in said), said
    cell_argv = json.load(open(os.path.join(spec.cell_dir(arm, 0), "argv.json")))
    assert "checkpoint.resume=auto" in cell_argv and "--overwrite" not in cell_argv
    assert "--overwrite" in json.load(open(os.path.join(spec.cold_start_dir(0), "argv.json")))


def test_a_report_with_missing_or_failed_runs_names_them_at_its_top(tmp_path):
    from megagspo.ablation import load_ablation, write_report

    spec = load_ablation(_write_recipe(tmp_path, seeds=[0, 1]), out_dir=str(tmp_path / "out"))
    cells = spec.cells()
    for cell in cells:
        for seed in (0, 1):
            if (cell, seed) not in ((cells[0], 1), (cells[1], 1)):
                _fake_cell(spec, cell, seed, 0.5, reward=0.5, tok_clip=0.01)
    failed = spec.cell_dir(cells[0], 1)
    text = open(write_report(spec, failed=[failed])).read().splitlines()
    assert text[2] == f"**Incomplete: 2 of {2 * len(cells)} cell runs are not in the numbers below.**", text[:6]
    assert text[3] == f"Failed: `{failed}` (logs in `{spec.out_dir}/logs/`).", text[:6]
    assert text[4].startswith(f"Missing or unfinished runs (not run yet, interrupted, or failed before): "
                              f"`{spec.cell_dir(cells[1], 1)}`"), text[:6]
