"""Runs an ablation's cold starts and (arm, seed) cells as `megagspo` subprocesses, `jobs` at a time.

Each run is an ordinary training run in its own folder (<out>/<arm>/seed<s>, <out>/cold_start/seed<s>), so a
cluster can run the same cells as separate jobs (`megagspo ablate --print-commands`) and `--report-only`
combines them afterwards. A run is done when its summary.json exists and its config.yaml equals the config
this ablation asks for; done runs are skipped, interrupted ones resume from their last checkpoint
(cells run with checkpoint.resume=auto; an interrupted cold start is redone with --overwrite, its attempt moved
aside), and a folder holding a different config is refused, not overwritten.
Subprocesses, not threads: Megatron's parallel state is process-global, and one run crashing must not take
the others down.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional


from megagspo.ablation.machine import record_machine
from megagspo.ablation.spec import AblationSpec
from megagspo.config import Config, ConfigError, read_yaml_mapping
from megagspo.config_moves import move_old_keys
from megagspo.metrics_log import rl_start_accuracy
from moe.json_files import read_json


@dataclass
class Run:
    kind: str              # "cold_start" | "cell"
    arm: str               # the cell ("<arm>" or "<setting>/<arm>", AblationSpec.cells); "cold_start" for cold starts
    seed: int
    run_dir: str
    command: str           # megagspo subcommand: sft | train
    overrides: List[str]

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"


def plan_runs(spec: AblationSpec, extra: List[str]) -> List[Run]:
    """Cold starts first (every cell of a seed needs its own), then cells seed-major: a partial ablation
    covers every cell (arm, or arm x setting) at the first seeds rather than every seed of the first cells."""
    runs = []
    if spec.cold_start == "sft":
        for seed in spec.seeds:
            runs.append(Run("cold_start", "cold_start", seed, spec.cold_start_dir(seed), "sft",
                            spec.cold_start_overrides(seed, extra)))
    for seed in spec.seeds:
        for cell in spec.cells():
            runs.append(Run("cell", cell, seed, spec.cell_dir(cell, seed), "train",
                            spec.cell_overrides(cell, seed, extra)))
    return runs


def expected_config(spec: AblationSpec, run: Run, extra: List[str]) -> dict:
    cfg = spec.cold_start_config(run.seed, extra) if run.kind == "cold_start" else spec.cell_config(run.arm, run.seed, extra)
    return cfg.to_dict()


def run_state(spec: AblationSpec, run: Run, extra: List[str]) -> str:
    """'done' | 'partial' (a folder from an interrupted attempt of this same config) | 'new'.
    Raises ConfigError when the folder holds a run of a different config."""
    cfg_path = os.path.join(run.run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        return "new"
    # duplicate keys, size, depth: as for a recipe; a run written before the rl sections compares under the new names
    saved = move_old_keys(read_yaml_mapping(cfg_path, "run config"), cfg_path)
    want = expected_config(spec, run, extra)
    for d in (saved, want):  # a progress bar, or how the run was started (--overwrite), does not make a different run
        d.get("log", {}).pop("progress", None)
        d.get("checkpoint", {}).pop("resume", None)
        # Derived from rl.routing_replay / rl.old_policy.source (compared there), not settings: a folder written before
        # they were derived holds the old default and is the same run.
        d.get("rollout", {}).pop("record_routes", None)
        (d.get("rollout", {}).get("sglang") or {}).pop("routing_replay", None)
    diff = _dict_diff(saved, want)
    if diff:
        raise ConfigError(f"{run.run_dir} holds a run with a different config ({'; '.join(diff[:4])}); use another "
                          "--out folder, or delete that run folder to redo it")
    return "done" if os.path.isfile(os.path.join(run.run_dir, "summary.json")) else "partial"


def _dict_diff(saved: dict, want: dict, prefix: str = "", defaults: Optional[dict] = None) -> List[str]:
    """Differences between a run folder's config.yaml and the asked config. A key the saved config lacks
    (a run from before that field existed) counts only when the asked value is not the field's default."""
    if defaults is None:
        defaults = Config().to_dict()
    out = []
    for key in sorted(set(saved) | set(want)):
        a, b = saved.get(key), want.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = defaults.get(key) if isinstance(defaults.get(key), dict) else {}
            out += _dict_diff(a, b, f"{prefix}{key}.", sub)
        elif key not in saved and key in defaults and b == defaults[key]:
            continue
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} there, {b!r} asked")
    return out


def shell_command(spec: AblationSpec, run: Run, launcher: str = "") -> str:
    """The command that runs `run`; with a launcher (e.g. "sbatch --nodes=1 launch/slurm.sbatch") the recipe and
    overrides are handed to it (the launchers run `megagspo train --config RECIPE ...`)."""
    args = " ".join(shlex.quote(o) for o in run.overrides)
    if launcher:  # the launchers run `train`; a cold start's overrides hold rl.steps=0, so it is the SFT-only run
        return f"{launcher} {shlex.quote(spec.base)} {args}"
    return f"megagspo {run.command} --config {shlex.quote(spec.base)} {args}"


class AblationStopped(Exception):
    """SIGINT / SIGTERM stopped the ablation after the running runs had checkpointed and exited (a rerun of the
    same command resumes them: cells from their checkpoints, an interrupted cold start anew)."""

    def __init__(self, signum: int, stopped: list, failed: list, not_started: list) -> None:
        self.signum, self.name, self.exit_code = signum, signal.Signals(signum).name, 128 + signum
        self.stopped = [run for run, _ in stopped]  # the runs that were running
        self.failed = list(failed)
        self.not_started = list(not_started)
        super().__init__(self.line())

    def line(self, command: str = "the same command") -> str:
        """The one line the CLI prints: what stopped, what to rerun."""
        said = f"stopped by {self.name}"
        if self.stopped:
            said += (f": {len(self.stopped)} running run(s) stopped at a checkpoint "
                     f"({', '.join(r.label for r in self.stopped)})")
        if self.not_started:
            said += f"; {len(self.not_started)} not started"
        if self.failed:
            said += f"; {len(self.failed)} failed ({', '.join(r.label for r in self.failed)})"
        return f"{said}; no report written; rerun {command} to resume them"


class AblationRunner:
    def __init__(self, spec: AblationSpec, extra: List[str], jobs: int = 1, say=print) -> None:
        if jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {jobs}")
        self.spec = spec
        self.extra = list(extra)
        self.jobs = jobs
        self.say = say
        self.log_dir = os.path.join(spec.out_dir, "logs")
        self.signals: List[int] = []  # SIGINT / SIGTERM received while the runs ran (_take_signals)

    def _start(self, run: Run, overwrite: bool = False) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"{run.arm.replace('/', '_')}_seed{run.seed}.log")
        env = dict(os.environ)
        # One process per core: intra-op threads come from the recipe's `threads`, OpenMP must not add more.
        env.setdefault("OMP_NUM_THREADS", "1")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "megagspo.cli", run.command, "--config", self.spec.base, *run.overrides,
               "log.progress=false"] + (["--overwrite"] if overwrite else [])
        log = open(log_path, "a")
        log.write(f"\n$ {' '.join(shlex.quote(c) for c in cmd)}\n")
        log.flush()
        start = os.path.getsize(log_path)  # where this attempt's part of the log begins (_has_stop reads it)
        # its own session: a terminal's Ctrl-C reaches the runner alone, which passes the stop on once (_stop_running)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc.log_start = start  # type: ignore[attr-defined]
        proc.log_path = log_path  # type: ignore[attr-defined]
        proc.log_file = log       # type: ignore[attr-defined]
        return proc

    # Over 60 lines: the scheduler's one loop (start, poll, restart, report) over a fixed number of job slots.
    def run(self) -> List[Run]:
        """Runs what is not done yet. -> the runs that failed (their logs are named in the output)."""
        runs = plan_runs(self.spec, self.extra)
        self.spec.validate_runs(self.extra)
        todo, restart = [], set()
        for run in runs:
            # The cell's log.progress=false is added on the command line only, so compare without it.
            state = run_state(self.spec, run, self.extra)
            if state == "done":
                self.say(f"[ablation] {run.label}: already done ({run.run_dir})")
            else:
                todo.append(run)
                if state == "partial" and run.kind == "cold_start":  # SFT has no checkpoint to resume from
                    restart.add(run.run_dir)
                    self.say(f"[ablation] {run.label}: an interrupted cold start in {run.run_dir}: redone, the "
                             "interrupted attempt moved aside")
                elif state == "partial":
                    self.say(f"[ablation] {run.label}: resuming an interrupted run in {run.run_dir}")
        if todo:  # the report names the CPU the runs ran on (megagspo/ablation/machine.py)
            record_machine(self.spec.out_dir)
        failed: List[Run] = []
        cold_failed = set()
        running: list = []
        pending = list(todo)
        t0 = time.perf_counter()
        done_count = len(runs) - len(todo)
        stopped: list = []  # (run, exit code) of the runs a signal stopped

        def reap() -> None:
            nonlocal done_count
            for item in list(running):
                run, proc, started = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                proc.log_file.close()
                took = time.perf_counter() - started
                if self.signals and proc.returncode in [128 + s for s in self.signals] + [-s for s in self.signals]:
                    stopped.append((run, proc.returncode))  # its trainer checkpointed and exited: a rerun resumes it
                    self.say(f"[ablation] {run.label}: stopped (exit {proc.returncode}) after {took:.0f} s; see "
                             f"{proc.log_path}")
                    continue
                done_count += 1
                if proc.returncode == 0:
                    self.say(f"[ablation] {run.label}: done in {took:.0f} s "
                             f"[{done_count}/{len(runs)}]{self._result(run)}")
                else:
                    failed.append(run)
                    if run.kind == "cold_start":
                        cold_failed.add(run.seed)
                    self.say(f"[ablation] {run.label}: FAILED (exit {proc.returncode}) after {took:.0f} s; "
                             f"see {proc.log_path}")

        previous = self._take_signals()
        try:
            while (pending or running) and not self.signals:
                # start what may start: a cell waits for its seed's cold start
                while pending and len(running) < self.jobs and not self.signals:
                    nxt = self._next_ready(pending, running, cold_failed)
                    if nxt is None:
                        break
                    pending.remove(nxt)
                    if nxt.kind == "cell" and nxt.seed in cold_failed:
                        failed.append(nxt)
                        self.say(f"[ablation] {nxt.label}: skipped, its cold start failed")
                        continue
                    proc = self._start(nxt, overwrite=nxt.run_dir in restart)
                    running.append((nxt, proc, time.perf_counter()))
                    self.say(f"[ablation] {nxt.label}: started ({nxt.run_dir}; log {proc.log_path})")
                time.sleep(0.5)
                reap()
            if self.signals:
                self._stop_running(running, reap)
        finally:
            self._give_back_signals(previous)
        if self.signals:
            raise AblationStopped(self.signals[0], stopped, failed, pending)
        self.say(f"[ablation] {len(todo) - len(failed)} run(s) finished, {len(failed)} failed, "
                 f"{len(runs) - len(todo)} were already done; {time.perf_counter() - t0:.0f} s")
        return failed

    # ---- a stop: SIGINT / SIGTERM to the runner --------------------------------------------------------
    def _take_signals(self) -> dict:
        """From here SIGINT and SIGTERM are recorded (self.signals) for the loop to act on, not raised mid-step
        (a KeyboardInterrupt inside Popen or a log write left half-done state). -> the handlers before."""
        self.signals = []
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, lambda signum, frame: self.signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _give_back_signals(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # A run that already has the stop says so in its log at once: the trainer's "received SIGTERM" line, or the
    # start-up guard's "stopped by SIGTERM" (megagspo.checkpoint.signals, megagspo.interrupts).
    ACKNOWLEDGED = ("megagspo: received SIG", "stopped by SIG")
    GRACE_S = 1.0  # how long a run that got the signal itself (a scheduler signals every process) has to say so

    def _stop_running(self, running: list, reap) -> None:
        """The stop reaches every running run exactly once: the run finishes its step, checkpoints and exits
        128 + signal (a trainer's second signal exits at once, without its checkpoint). The runs have their own
        sessions, so a terminal's Ctrl-C or a `kill` of the runner reaches the runner alone and is passed on; a
        scheduler that signals every process of the job (Slurm at its time limit) reaches the runs itself, which
        their logs show within GRACE_S: those are not signalled again. The runner waits for every run, so that a
        rerun finds no run folder still in use. A second signal to the runner is passed on to all: they exit
        at once."""
        deadline = time.perf_counter() + self.GRACE_S
        while running and time.perf_counter() < deadline:
            time.sleep(0.1)
            reap()
        first = self.signals[0]
        told = [proc for _, proc, _ in running if not self._has_stop(proc)]
        for proc in told:
            proc.send_signal(first)
        if running:
            self.say(f"[ablation] {signal.Signals(first).name}: {len(running)} running run(s) finish their step and "
                     f"checkpoint ({len(told)} told by the runner, {len(running) - len(told)} signalled themselves)")
        forwarded = 1
        while running:
            time.sleep(0.2)
            while forwarded < len(self.signals):  # another signal: the trainers exit at once
                for _, proc, _ in running:
                    if proc.poll() is None:
                        proc.send_signal(self.signals[forwarded])
                forwarded += 1
            reap()

    def _has_stop(self, proc) -> bool:
        """Whether this attempt's log (from where it started) shows that the run got the stop already."""
        try:
            with open(proc.log_path, "rb") as f:
                f.seek(proc.log_start)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return False
        return any(mark in text for mark in self.ACKNOWLEDGED)

    @staticmethod
    def _next_ready(pending: List[Run], running: list, cold_failed: set) -> Optional[Run]:
        busy_cold = {r.seed for r, _, _ in running if r.kind == "cold_start"}
        pending_cold = {r.seed for r in pending if r.kind == "cold_start"}
        for run in pending:
            if run.kind == "cold_start":
                return run
            if run.seed in cold_failed or (run.seed not in busy_cold and run.seed not in pending_cold):
                return run
        return None

    @staticmethod
    def _result(run: Run) -> str:
        path = os.path.join(run.run_dir, "summary.json")
        try:
            s = read_json(path)
        except ValueError:  # JsonFileError: unreadable, too large, too deep, not an object
            return ""
        if run.kind == "cold_start":
            return f"; cold-start held-out accuracy {rl_start_accuracy(s):.3f}"
        return (f"; held-out accuracy {rl_start_accuracy(s):.3f} -> "
                f"{s.get('final/accuracy', float('nan')):.3f}")
