"""Issue 41: every stop, restart and refusal tells the truth (rules in docs/robustness.md).

1. A signal at any moment of start-up (while torch, Megatron-Core and transformers import, while the run is being
   built) is one line and exit 128 + signal; before the first write nothing is written; after it (the run
   folder's files are there) the stop waits for no step and names the way on.
2. After a stop before the first checkpoint (Ctrl-C during cold-start SFT) the stop line, the --resume refusal
   and a plain start agree: the same command again starts over, the old rows moved aside.
3. --resume with rl.steps below the checkpoint's step is refused in one line naming both steps; nothing written.
4. Verifier time-outs in held-out evaluation are counted (eval/timeouts) and said in the held-out line.
5. Prompts over data.max_prompt_tokens with the default data.drop_long_prompts=false: the error speaks of the
   user's setting, not of the held-out split's internal one.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, CliRuns
from multiprocess import cpu_pinned_env

TINY = ["sft.steps=3", "sft.batch_size=4", "rl.steps=2", "rl.batch.prompts_per_step=2", "rl.batch.group_size=2",
        "rl.batch.mini_batches=1", "rl.eval.every=1", "rl.eval.samples=0", "data.train_size=50", "data.eval_size=5",
        "log.progress=false", "log.plots=false", "log.tensorboard=false", "threads=1"]
CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
STARTUP_LINE = "megagspo train: stopped by {} during start-up; nothing was written"


def _env():
    return cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _args(out_dir, *extra):
    return ["train", "--config", CONFIG, *TINY, f"log.out_dir={out_dir}", "name=r", *extra]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's runs that are only read afterwards (the plain restart, the finished run): a
    run costs its training, not a fresh start-up. The runs signalled during start-up have processes of their own."""
    runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _snapshot(root):
    """sha256 of every file under root but the lock file (it names the folder's owner; it is not run data)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name != ".megagspo.lock":
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# The CLI as the `megagspo` console script runs it (`from megagspo.cli import main`), with a signal sent to itself
# at one chosen moment: when a module is first imported (a meta-path finder: the signal lands inside that
# import), or when a Trainer step of start-up begins or ends (a wrapped function). Deterministic, unlike a timer.
SIGNAL_AT = r"""
import importlib, json, os, signal, sys

moment, signame, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sig = getattr(signal, signame)


class SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == moment[len("import:"):]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), sig)
        return None


if moment.startswith("import:"):
    sys.meta_path.insert(0, SignalOnImport())
else:  # "before:<module>.<function>" / "after:<module>.<function>" / "sft_step:<n>"
    from megagspo.cli import _quiet_third_party

    _quiet_third_party()  # what main() does before these modules load (the harness loads them earlier)
    when, _, where = moment.partition(":")
    if when == "sft_step":
        from megagspo.trainer import sft
        step, calls = int(where), []
        original = sft.ColdStartSFT._step

        def _step(self, *a, **k):
            calls.append(1)
            if len(calls) == step:
                os.kill(os.getpid(), sig)
            return original(self, *a, **k)

        sft.ColdStartSFT._step = _step
    else:
        module_name, _, fn_name = where.rpartition(".")
        module = importlib.import_module(module_name)
        original = getattr(module, fn_name)

        def wrapped(*a, **k):
            if when == "before":
                os.kill(os.getpid(), sig)
            out = original(*a, **k)
            if when == "after":
                os.kill(os.getpid(), sig)
            return out

        setattr(module, fn_name, wrapped)

from megagspo.cli import main

sys.exit(main(args))
"""


def _cli_with_signal(moment, args, signame="SIGINT"):
    return subprocess.run([sys.executable, "-c", SIGNAL_AT, moment, signame, json.dumps(args)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=240)


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------ 1. signals at start-up
@pytest.mark.parametrize("moment,signame", [
    ("import:torch", "SIGINT"),                        # the commands module's first heavy import
    ("import:megatron.core", "SIGINT"),                # the Trainer's import: Megatron-Core
    ("import:transformers", "SIGINT"),                 # where the 36-line traceback used to end
    ("import:transformers", "SIGTERM"),                # a scheduler's stop: same rule, 128 + 15
    ("before:megagspo.trainer.trainer.build_models", "SIGINT"),  # run folder locked, the model being built
])
def test_a_signal_during_start_up_is_one_line_exit_128_plus_signal_and_writes_nothing(tmp_path, moment, signame):
    proc = _cli_with_signal(moment, _args(tmp_path), signame)
    signum = getattr(signal, signame)
    assert proc.returncode == 128 + signum, (proc.returncode, proc.stderr[-3000:])
    assert _lines(proc.stderr) == [STARTUP_LINE.format(signame)], proc.stderr[-3000:]
    assert proc.stdout == ""
    # nothing; at the later moment the lock file, which names who held the folder and counts as no run
    left = os.listdir(tmp_path / "r") if (tmp_path / "r").exists() else []
    assert [n for n in left if n != ".megagspo.lock"] == [] and os.listdir(tmp_path) in ([], ["r"]), left


def test_ctrl_c_to_the_megagspo_script_while_torch_loads_is_one_line(tmp_path):
    """The installed console script, a real Ctrl-C: sent once torch's library is mapped into the process (it is
    importing), and again to a second process half a second later."""
    script = os.path.join(os.path.dirname(sys.executable), "megagspo")
    if not os.path.exists(script):
        pytest.skip("no megagspo console script next to this Python (the package is not installed)")
    for extra_wait in (0.0, 0.5):
        proc = subprocess.Popen([script, *_args(tmp_path)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/maps") as f:
                    if "libtorch" in f.read():
                        break
            except OSError:
                pass
            time.sleep(0.01)
        time.sleep(extra_wait)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (proc.returncode, err[-3000:])
        assert _lines(err) == [STARTUP_LINE.format("SIGINT")], err[-3000:]
        assert out == "" and not os.path.exists(tmp_path / "r")


# ------------------------------------------- 2. a stop before the first checkpoint: one way on, said everywhere
@pytest.fixture(scope="module")
def stopped_in_sft(tmp_path_factory):
    """A run stopped by Ctrl-C after cold-start SFT step 2 of 3 (no checkpoint yet)."""
    out = tmp_path_factory.mktemp("sft_stop")
    proc = _cli_with_signal("sft_step:2", _args(out))
    return out, proc


def test_the_sft_stop_line_names_the_one_way_on(stopped_in_sft):
    out, proc = stopped_in_sft
    assert proc.returncode == 130, proc.stderr[-3000:]
    last = _lines(proc.stderr)[-1]
    assert last == ("megagspo train: stopped by SIGINT during cold-start SFT (after step 2 of 3); no checkpoint yet: "
                    "to start over, run the same command again without --resume: it moves the rows logged so far "
                    "aside to r.replaced-<time>/"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(n for n in os.listdir(out / "r") if n != ".megagspo.lock") == ["config.yaml", "metrics.jsonl"]


def test_resume_after_the_sft_stop_names_the_same_way_on_and_writes_nothing(stopped_in_sft, capsys):
    from megagspo.cli import main

    out, _ = stopped_in_sft
    before = _snapshot(out)
    rc = main(_args(out, "--resume"))
    err = capsys.readouterr().err
    assert rc == 2 and len(_lines(err)) == 1, err
    assert "stopped before its first checkpoint" in err and \
        "to start over, run the same command again without --resume: it moves the rows logged so far aside to " \
        "r.replaced-<time>/" in err, err
    assert _snapshot(out) == before


def test_the_same_command_again_starts_over_moving_the_old_rows_aside(cli, stopped_in_sft):
    """What the stop line and the refusal promise: the plain start runs to the end; the stopped run's rows are in
    r.replaced-<time>/ byte for byte. Runs after the two tests above (it changes the folder)."""
    out, _ = stopped_in_sft
    before = _snapshot(out / "r")
    proc = cli.run(_args(out), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = glob.glob(str(out / "r.replaced-*"))
    assert len(aside) == 1 and _snapshot(aside[0]) == before, (aside, proc.stdout)
    assert f"moved whole to {aside[0]}" in proc.stdout
    rows = [json.loads(line) for line in open(out / "r" / "metrics.jsonl")]
    assert sum(r["phase"] == "rl" for r in rows) == 2 and os.path.exists(out / "r" / "summary.json")


def test_a_plain_start_takes_over_only_a_folder_without_a_checkpoint(tmp_path):
    from megagspo.checkpoint.run_folder import FolderHoldsRun, check_fresh_start, holds_no_checkpoint

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / ".megagspo.lock").write_text("{}")
    assert not holds_no_checkpoint(str(run_dir))  # only the lock: no earlier run at all
    (run_dir / "metrics.jsonl").write_text('{"phase": "sft", "step": 0}\n')
    (run_dir / "config.yaml").write_text("seed: 5\n")  # another config: still only rows to lose
    (run_dir / "tb").mkdir()
    (run_dir / "checkpoints").mkdir()
    assert holds_no_checkpoint(str(run_dir))
    check_fresh_start(str(run_dir), {"seed": 0})  # not refused
    for extra, make in [("checkpoints/step_000000", lambda p: p.mkdir()),
                        ("cold_start.pt", lambda p: p.write_bytes(b"weights")),
                        ("summary.json", lambda p: p.write_text("{}")),
                        ("notes.txt", lambda p: p.write_text("the user's own file"))]:
        path = run_dir / extra
        make(path)
        assert not holds_no_checkpoint(str(run_dir)), extra
        with pytest.raises(FolderHoldsRun, match="--resume continues it"):
            check_fresh_start(str(run_dir), {"seed": 0})
        path.rmdir() if path.is_dir() else path.unlink()
    (run_dir / "metrics.jsonl").unlink()
    os.symlink(tmp_path / "elsewhere.jsonl", run_dir / "metrics.jsonl")  # never moved as if it were the run's
    assert not holds_no_checkpoint(str(run_dir))


def test_a_signal_after_the_run_folder_is_written_stops_before_the_first_step(tmp_path):
    """From the first write on the trainer's own stop answers: no step is taken, the line says what is there."""
    proc = _cli_with_signal("after:megagspo.trainer.trainer.open_run_files", _args(tmp_path))
    assert proc.returncode == 130, proc.stderr[-3000:]
    lines = _lines(proc.stderr)
    assert lines[-1] == ("megagspo train: stopped by SIGINT during start-up, before the first training step; no "
                         "checkpoint yet: to start over, run the same command again without --resume: it moves the "
                         "rows logged so far aside to r.replaced-<time>/"), proc.stderr[-3000:]
    assert len(lines) == 2 and "received SIGINT" in lines[0]  # the trainer's acknowledgement, then the stop
    assert "held-out accuracy" not in proc.stdout and open(tmp_path / "r" / "metrics.jsonl").read() == ""


# ------------------------------------------------------------------ 3. --resume never takes steps back
@pytest.fixture(scope="module")
def finished_run(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    proc = cli.run(_args(out, "sft.steps=1"), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isdir(out / "r" / "checkpoints" / "step_000002")
    return out


@pytest.mark.parametrize("finished", [True, False])
def test_resume_below_the_checkpoints_step_is_refused_in_one_line_and_writes_nothing(finished_run, tmp_path,
                                                                                   capsys, finished):
    from megagspo.cli import main

    shutil.copytree(finished_run / "r", tmp_path / "r", symlinks=True)
    if not finished:  # as a run stopped after its last checkpoint: no summary, no checkpoint.pt
        (tmp_path / "r" / "summary.json").unlink()
        (tmp_path / "r" / "checkpoint.pt").unlink()
    before = _snapshot(tmp_path)
    rc = main(_args(tmp_path, "sft.steps=1", "--resume", "rl.steps=1"))
    captured = capsys.readouterr()
    lines = _lines(captured.err)
    assert rc == 2 and len(lines) == 1, captured.err
    assert "step_000002 is after RL step 2, past rl.steps = 1" in lines[0], lines[0]
    assert "rl.steps=3 is the smallest that continues it" in lines[0], lines[0]
    assert "held-out accuracy" not in captured.out
    assert _snapshot(tmp_path) == before


def test_resume_step_rule():
    from megagspo.checkpoint.run_folder import check_resume_reaches
    from megagspo.checkpoint.store import CheckpointError

    point = {"path": "runs/x/checkpoints/step_000006", "state": {"step": 6}}
    for steps in (6, 7, 400):  # 6: finishes a run stopped after its last step; more: continues it
        check_resume_reaches(point, steps)
    with pytest.raises(CheckpointError, match=r"after RL step 6, past rl.steps = 3: .*rl.steps=7 is the smallest"):
        check_resume_reaches(point, 3)


# --------------------------------------------------------- 4. verifier time-outs in held-out evaluation
def test_held_out_time_outs_are_counted_and_said():
    import torch

    from megagspo.config import load_config
    from megagspo.data import build_datasets
    from megagspo.metrics_log import cold_start_line, final_line
    from megagspo.rewards.bounded import with_time_limit
    from megagspo.rollout.base import RolloutOutput
    from megagspo.trainer.evaluation import Evaluator

    cfg = load_config(CONFIG, ["data.train_size=20", "data.eval_size=3"])
    tok, _, held_out, _ = build_datasets(cfg.data)

    class Dims:
        dp_rank, dp_size = 0, 1

        def on_mp_rank0(self, _what, fn):
            return fn()

        def dp_sum(self, values):
            return values

    class Engine:  # every response is "1" + eos
        def generate(self, prompts, n, params):
            ids = torch.tensor([tok.encode("1") + [tok.eos_id]] * (len(prompts) * n))
            return RolloutOutput([list(p) for p in prompts for _ in range(n)], ids,
                                 torch.ones_like(ids, dtype=torch.bool), torch.zeros(ids.shape))

    def hangs(response, answer):  # as math-verify on a hostile reference answer: cut off at the limit
        while True:
            time.sleep(0.01)

    verifier = with_time_limit(hangs, 0.3)
    try:
        engine = Engine()
        result = Evaluator(Dims(), lambda: engine, tok, verifier, held_out, 5, 0, 1.0, 1.0)()
    finally:
        getattr(verifier, "close", lambda: None)()
    assert result["eval/timeouts"] == 3 and result["eval/accuracy"] == 0.0, result
    n = 3
    calm = {**result, "eval/timeouts": 0.0}
    said = f"{n} verifier call{'s' if n != 1 else ''} timed out at reward.timeout_s and scored 0 (eval/timeouts)"
    assert said in final_line(result, calm, 4, "gspo", 1, 0, 1.0)
    assert "timed out" not in final_line(calm, calm, 4, "gspo", 1, 0, 1.0)
    line = cold_start_line(calm, result, 10)
    assert line.endswith(f"; verifier calls that timed out at reward.timeout_s and scored 0 (eval/timeouts): {n} "
                         "after cold-start SFT"), line
    assert "timed out" not in cold_start_line(calm, calm, 10)


# --------------------------------------------------------- 5. the error speaks of the user's own settings
def test_prompts_over_the_limit_name_the_users_drop_setting(tmp_path, capsys):
    from megagspo.cli import main

    rc = main(_args(tmp_path, "data.max_prompt_tokens=4"))
    err = capsys.readouterr().err
    assert rc == 2 and len(_lines(err)) == 1 and "Traceback" not in err, err
    assert "drop_long_prompts=true dropped them" not in err, err  # the user left it false: nothing was dropped
    assert "55 of 55 prompts are longer than data.max_prompt_tokens = 4" in err, err
    assert "raise the limit or set data.drop_long_prompts=true to drop them" in err, err
    assert not os.path.exists(tmp_path / "r")
    # with data.drop_long_prompts=true the same data is dropped, and the error says that
    rc = main(_args(tmp_path, "data.max_prompt_tokens=4", "data.drop_long_prompts=true"))
    err = capsys.readouterr().err
    assert rc == 2 and "data.drop_long_prompts=true dropped them" in err, err


def test_held_out_prompts_alone_over_the_limit_name_the_users_drop_setting(tmp_path):
    from megagspo.config import load_config
    from megagspo.data import build_datasets
    from megagspo.data.datasets import DataError

    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n" for _ in range(20)))
    held.write_text("".join(json.dumps({"prompt": "1+2=" * 10, "answer": "3"}) + "\n" for _ in range(5)))
    cfg = load_config(CONFIG, ["data.task=file", f"data.train_path={train}", f"data.eval_path={held}",
                               "data.max_prompt_tokens=8"])
    with pytest.raises(DataError) as info:
        build_datasets(cfg.data)
    assert str(info.value).startswith(f"{held}: 5 of 5 prompts are longer than data.max_prompt_tokens = 8"), info.value
    assert "set data.drop_long_prompts=true to drop them" in str(info.value)
