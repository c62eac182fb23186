"""A run folder that already holds a run: what a new start there may do, so that a rerun never loses a run.

    checkpoint.resume = ""      (a plain `megagspo train`) refused over an earlier run: FolderHoldsRun names
                                --resume and --overwrite; a FINISHED run of the same config is not started over
                                (RunAlreadyFinished: the CLI prints its summary and exits 0). A run that stopped
                                before its first checkpoint (holds_no_checkpoint) is taken over instead: moved
                                aside as with --overwrite, since it has nothing to lose but its metric rows
    checkpoint.resume = never   (`--overwrite`) the whole earlier run (metrics, summary, plots, config,
                                TensorBoard events, checkpoints, exports) moves to ONE sibling folder
                                `<run>.replaced-<time>/` before this run writes anything; nothing is deleted
                                or truncated, and that folder is a complete run folder (resume, export, plots)
    checkpoint.resume = auto    as latest when there is a checkpoint, else as never (requeued jobs, ablation cells)

Everything in the folder except its lock file (megagspo.checkpoint.run_lock, held by this process) counts.
"""

from __future__ import annotations

import json
import os
import time
from typing import List, Optional

from megagspo.config import Config, ConfigError, flatten_keys, read_yaml_mapping
from megagspo.config_moves import move_old_keys
from moe.json_files import JsonFileError, read_json

from .run_lock import LOCK_FILE
from .store import MANIFEST, CheckpointError

SUMMARY = "summary.json"
CONFIG = "config.yaml"
# How a run was started, not what it is: a rerun that differs only here is the same run.
NOT_RUN_DEFINING = ("checkpoint.resume", "log.progress")


class FolderHoldsRun(CheckpointError):
    """A fresh start in a folder that holds an earlier run (neither --resume nor --overwrite given)."""


class RunAlreadyFinished(CheckpointError):
    """The folder holds a finished run of exactly this config: nothing to do. `summary` is its summary.json."""

    def __init__(self, message: str, summary: Optional[dict] = None) -> None:
        super().__init__(message)
        self.summary = summary or {}


def earlier_run(run_dir: str) -> List[str]:
    """Names of what an earlier run left in run_dir (sorted; empty when there is none)."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n != LOCK_FILE)


# What a run writes before its first checkpoint (step_000000 comes right after cold-start SFT): the metric rows,
# its config, TensorBoard events, and (after a cut-off first save) an empty checkpoints/ folder.
BEFORE_FIRST_CHECKPOINT = {"metrics.jsonl": "file", CONFIG: "file", "tb": "dir", "checkpoints": "empty dir"}


def holds_no_checkpoint(run_dir: str) -> bool:
    """True when run_dir holds an earlier run that stopped before its first checkpoint (Ctrl-C during start-up
    or cold-start SFT, a crash there): nothing but what BEFORE_FIRST_CHECKPOINT names, each of its kind (no
    symbolic link). Such a run has nothing a restart could lose but its metric rows, and a plain start takes
    the folder over (the rows move aside with the rest); anything else (a checkpoint, cold_start.pt, a summary,
    a file no run writes) keeps the folder a run to continue or to move aside on purpose."""
    names = earlier_run(run_dir)
    if not names:
        return False
    for name in names:
        path = os.path.join(run_dir, name)
        kind = BEFORE_FIRST_CHECKPOINT.get(name)
        if kind is None or os.path.islink(path):
            return False
        if kind == "file" and not os.path.isfile(path):
            return False
        if kind != "file" and not os.path.isdir(path):
            return False
        if kind == "empty dir" and os.listdir(path):
            return False
    return True


def start_over_hint(run_dir: str) -> str:
    """The one way on after a stop before the first checkpoint, as the stop line and the --resume refusal say it
    (a plain start then takes the folder over: check_fresh_start)."""
    return (f"to start over, run the same command again without --resume: it moves the rows logged so far aside to "
            f"{os.path.basename(os.path.normpath(run_dir))}.replaced-<time>/")


def nothing_to_resume(run_dir: str, root: str) -> str:
    """--resume's refusal where run_dir holds no checkpoint to continue, naming the command that works."""
    names = earlier_run(run_dir)
    if not names:
        return (f"--resume: no checkpoint under {root} to continue; run without --resume to start a fresh run, or "
                "pass checkpoint.resume=auto to resume when there is one and start fresh otherwise")
    if holds_no_checkpoint(run_dir):
        return (f"--resume: the run in {run_dir} stopped before its first checkpoint (during start-up or cold-start "
                f"SFT): nothing to continue; {start_over_hint(run_dir)}")
    return (f"--resume: no checkpoint under {root} to continue (the folder holds {listing(run_dir, names)}); "
            f"--overwrite moves that aside to {os.path.basename(os.path.normpath(run_dir))}.replaced-<time>/ and "
            "starts fresh, or pass name=OTHER to run beside it")


def check_resume_reaches(point: dict, rl_steps: int) -> None:
    """A resume continues a run; it never takes steps back. A checkpoint past rl.steps is refused before anything
    is written: continuing would rewrite config.yaml to the smaller rl.steps and write summary.json and
    checkpoint.pt for a run of rl.steps steps that never happened. rl.steps equal to the checkpoint's step
    finishes the run where it stands (a stop after its last step)."""
    step = int(point["state"]["step"])
    if step > rl_steps:
        raise CheckpointError(f"--resume: {point['path']} is after RL step {step}, past rl.steps = {rl_steps}: a "
                              f"resume cannot take steps back; rl.steps={step + 1} is the smallest that continues "
                              "it (or start a fresh run: --overwrite, or name=OTHER)")


def check_not_finished(run_dir: str, path: str, step: int, rl_steps: int) -> None:
    """--resume of a run that has finished: its newest checkpoint is after RL step rl.steps (its last) and its
    summary.json was written after that checkpoint (at the run's end; a summary from before it belongs to the
    shorter run this one continued). Raises RunAlreadyFinished, whose summary the CLI prints as for a plain rerun:
    continuing would rewrite config.yaml, metrics.jsonl, summary.json (its times measured anew, over nothing) and
    checkpoint.pt for steps that ran before."""
    if not rl_steps or step != rl_steps:
        return
    summary = _read_summary(run_dir)
    try:
        finished = summary is not None and os.path.getmtime(os.path.join(run_dir, SUMMARY)) >= \
            os.path.getmtime(os.path.join(path, MANIFEST))
    except OSError:
        finished = False
    if finished:
        raise RunAlreadyFinished(f"--resume: {run_dir} holds a finished run: {os.path.basename(path)} is after RL "
                                 f"step {step}, the last of rl.steps = {rl_steps}; nothing to continue, nothing "
                                 f"rewritten (--resume rl.steps={step + 1} or more continues it)", summary)


def listing(run_dir: str, names: List[str]) -> str:
    """'metrics.jsonl, checkpoints/, ...': names in run_dir as a line shows them (folders with a slash, at most 8)."""
    shown = ", ".join(n + ("/" if os.path.isdir(os.path.join(run_dir, n)) else "") for n in names[:8])
    return shown + (", ..." if len(names) > 8 else "")


def _read_summary(run_dir: str) -> Optional[dict]:
    path = os.path.join(run_dir, SUMMARY)
    if not os.path.isfile(path):
        return None
    try:
        summary = read_json(path)
    except (JsonFileError, OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def config_differences(run_dir: str, asked: dict) -> List[str]:
    """['seed: 0 there, 1 asked', ...] between the folder's config.yaml and the asked config (flattened, without
    NOT_RUN_DEFINING); ['config.yaml is missing or unreadable'] when it cannot be compared. A key the saved
    config lacks (written before that field existed) ran at its default."""
    try:
        path = os.path.join(run_dir, CONFIG)
        saved = flatten_keys(move_old_keys(read_yaml_mapping(path, "run config"), path))  # a run before the rl sections
    except ConfigError:
        return [f"{CONFIG} is missing or unreadable"]
    now, defaults = flatten_keys(asked), flatten_keys(Config().to_dict())
    return [f"{k}: {saved.get(k, defaults.get(k))!r} there, {now.get(k)!r} asked" for k in sorted(set(saved) | set(now))
            if k not in NOT_RUN_DEFINING and saved.get(k, defaults.get(k)) != now.get(k)]


def check_fresh_start(run_dir: str, asked: dict) -> None:
    """A plain fresh start (checkpoint.resume = "") may go ahead only in a folder without an earlier run.
    Raises RunAlreadyFinished (a finished run of this very config) or FolderHoldsRun (anything else)."""
    names = earlier_run(run_dir)
    if not names or holds_no_checkpoint(run_dir):  # the latter is moved aside (retire_previous), then run over
        return
    summary = _read_summary(run_dir)
    diff = config_differences(run_dir, asked)
    if summary is not None and not diff:
        raise RunAlreadyFinished(f"{run_dir} already holds a finished run of this config: not starting over "
                                 "(--overwrite moves it aside and runs again; name=OTHER runs beside it)", summary)
    shown = listing(run_dir, names)
    state = "a finished run" if summary is not None else "an unfinished run (no summary.json)"
    if diff:
        state += f" of a different config ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})"
    raise FolderHoldsRun(f"{run_dir} already holds {state}: {shown}. Refusing to start a fresh run over it: "
                         "--resume continues it from its newest checkpoint; --overwrite moves the whole earlier "
                         f"run aside to {os.path.basename(run_dir)}.replaced-<time>/ and starts fresh; "
                         "or pass name=OTHER to run beside it")


def aside_path(run_dir: str) -> str:
    """A free sibling `<run>.replaced-<YYYYmmdd-HHMMSS>[-n]` (never an existing path)."""
    base = f"{os.path.normpath(run_dir)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while os.path.lexists(path):
        path, n = f"{base}-{n}", n + 1
    return path


def move_earlier_run_aside(run_dir: str) -> Optional[str]:
    """Move everything in run_dir but the lock into one new sibling folder; -> that folder, or None when the
    folder held nothing. Renames only (the sibling is on the same filesystem): no file is copied, truncated or
    deleted, and a file that was open for appending keeps its content."""
    names = earlier_run(run_dir)
    if not names:
        return None
    aside = aside_path(run_dir)
    os.makedirs(aside)
    for name in names:
        os.rename(os.path.join(run_dir, name), os.path.join(aside, name))
    return aside


def summary_lines(summary: dict) -> List[str]:
    """A finished run's summary.json as lines a person reads: the accuracies and times first, then the rest."""
    def shown(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        if isinstance(value, (list, dict)):
            return json.dumps(value) if len(json.dumps(value)) < 100 else f"({len(value)} entries)"
        return str(value)

    keys = sorted(summary, key=lambda k: (not k.endswith("accuracy"), k))
    return [f"  {k:<30} {shown(summary[k])}" for k in keys]


__all__ = ["BEFORE_FIRST_CHECKPOINT", "FolderHoldsRun", "RunAlreadyFinished", "aside_path", "check_fresh_start",
           "check_not_finished", "check_resume_reaches", "config_differences", "earlier_run", "holds_no_checkpoint", "listing",
           "move_earlier_run_aside", "nothing_to_resume", "start_over_hint", "summary_lines"]
