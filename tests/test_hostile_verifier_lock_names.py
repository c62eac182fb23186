"""Hostile inputs on the newer surfaces (issue 31 §1, §2, §5; rows in docs/robustness.md): a reference answer
that hangs math-verify in C code is cut off at reward.timeout_s and counted, a lock file planted as a symlink is
refused and its target untouched, run names that would escape log.out_dir are refused naming the rule, and
errors show a bounded part of a huge input and the counts behind a refusal."""

import json
import os
import subprocess
import sys
import time

import pytest

from helpers import REPO
from multiprocess import cpu_pinned_env

TINY = ["sft.steps=1", "sft.batch_size=4", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2",
        "rl.mini_batches=1", "data.train_size=50", "data.eval_size=5", "log.progress=false", "threads=1",
        "log.plots=false", "log.tensorboard=false"]


# ------------------------------------------------------------------------------------- §1 verifier bounded
# Scored in a child process under subprocess.run's timeout: the hard outer limit. In-process limits (SIGALRM,
# pytest-timeout's signal or thread method) cannot stop a C-level loop that holds the GIL, which is the bug.
HANG_SCRIPT = r"""
import json, sys, time
from megagspo.checkpoint import with_time_limit  # the trainer's wrapper (kept importable there)
from megagspo.rewards import RewardStats, get_reward, score_batch

gold, limit = sys.argv[1], float(sys.argv[2])
get_reward("math")("\\boxed{3}", "3")  # math-verify imported here too: an in-process limit must not count that
verifier = with_time_limit(get_reward("math"), limit)
first = verifier("\\boxed{3}", "3")  # starts (and warms) a worker outside the timed call
stats = RewardStats()
t0 = time.perf_counter()
scores = score_batch(verifier, ["\\boxed{3}"], [gold], stats)
took = time.perf_counter() - t0
after = score_batch(verifier, ["so 70 + 2 = 72"], ["72"], stats)  # a new worker, the right verdict
print(json.dumps({"first": first, "scores": scores, "after": after, "took": took, "errors": stats.errors,
                  "timeouts": getattr(stats, "timeouts", None), "first_error": stats.first_error}))
"""


@pytest.mark.parametrize("gold", ["10^{10^{10^{10}}}", "9^{9^{9}}"])
def test_math_reward_hanging_in_c_is_cut_off_at_timeout_and_counted(gold):
    env = cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    limit = 1.0
    try:
        proc = subprocess.run([sys.executable, "-c", HANG_SCRIPT, gold, str(limit)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scoring the reference {gold!r} with reward.timeout_s = {limit} ran past 120 s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["first"] == 1.0 and got["scores"] == [0.0] and got["after"] == [1.0]
    assert got["errors"] == 1 and got["timeouts"] == 1
    assert got["first_error"].startswith("VerifierTimeout") and "reward.timeout_s = 1" in got["first_error"]
    assert got["took"] < limit + 1.0, f"the cut-off call took {got['took']:.2f} s (limit {limit} s)"


@pytest.mark.timeout(120)
def test_bounded_math_reward_gives_the_in_process_verdicts():
    from test_rewards_math import CASES

    from megagspo.rewards import RewardStats, get_reward, score_batch
    from megagspo.rewards.bounded import BoundedVerifier, with_time_limit

    verifier = with_time_limit(get_reward("math"), 10.0)
    assert isinstance(verifier, BoundedVerifier)
    try:
        stats = RewardStats()
        responses, answers, expected = zip(*CASES)
        assert score_batch(verifier, list(responses) + ["\\boxed{3}"], list(answers) + ["}{"], stats) == \
            list(expected) + [0.0]
        # a verifier's own error still reads as before and is not a timeout
        assert stats.errors == 1 and stats.timeouts == 0 and "not a mathematical expression" in stats.first_error
        assert verifier.starts == 1
    finally:
        verifier.close()


def test_cannot_hang_string_rewards_stay_in_process():
    from megagspo.rewards import get_reward
    from megagspo.rewards.bounded import with_time_limit

    for name in ("exact_match", "digit_match", "last_number"):
        fn = get_reward(name)
        assert with_time_limit(fn, 10.0) is fn


@pytest.mark.timeout(60)
def test_verifier_worker_that_dies_is_counted_and_replaced():
    from megagspo.rewards import RewardStats, score_batch
    from megagspo.rewards.bounded import VerifierCrashed, with_time_limit

    def dies(response, answer):  # a closure: runs in a fork of this process
        if response == "die":
            os._exit(3)
        return 1.0

    verifier = with_time_limit(dies, 5.0)
    try:
        stats = RewardStats()
        assert score_batch(verifier, ["ok", "die", "ok"], ["a"] * 3, stats) == [1.0, 0.0, 1.0]
        assert stats.errors == 1 and stats.timeouts == 0
        assert stats.first_error.startswith(VerifierCrashed.__name__) and "exit code 3" in stats.first_error
    finally:
        verifier.close()


def test_a_verifier_error_quoting_a_huge_input_is_cut():
    from megagspo.rewards import RewardStats, score_batch

    def echoes(response, answer):
        raise ValueError(f"cannot read {response!r}")

    stats = RewardStats()
    score_batch(echoes, ["x" * 10_000_000], ["a"], stats)
    assert len(stats.first_error) < 400 and "characters)" in stats.first_error


# ------------------------------------------------------------------------------------------- §2 the lock
def test_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    from megagspo.checkpoint.run_lock import LOCK_FILE, LockFileRefused, RunFolderBusy, RunFolderLock

    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir()
    target.write_text("precious\n")
    before = (target.read_bytes(), os.stat(target).st_mtime_ns)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    os.symlink(target, run_dir / LOCK_FILE)
    with pytest.raises(LockFileRefused, match=f"{run_dir / LOCK_FILE} is a symbolic link") as err:
        RunFolderLock(str(run_dir), "megagspo train").acquire()
    assert isinstance(err.value, RunFolderBusy)  # every caller's one-line error handles it
    assert (target.read_bytes(), os.stat(target).st_mtime_ns) == before


def test_lock_file_that_is_not_a_plain_file_is_refused(tmp_path):
    from megagspo.checkpoint.run_lock import LOCK_FILE, LockFileRefused, RunFolderLock

    fifo_run, dir_run, link_run = tmp_path / "fifo", tmp_path / "dir", tmp_path / "hardlink"
    for d in (fifo_run, dir_run, link_run):
        d.mkdir()
    os.mkfifo(fifo_run / LOCK_FILE)
    (dir_run / LOCK_FILE).mkdir()
    (tmp_path / "other.txt").write_text("other\n")
    os.link(tmp_path / "other.txt", link_run / LOCK_FILE)
    for run_dir, why in ((fifo_run, "not a regular file"), (dir_run, "not a regular file"),
                         (link_run, "has 2 hard links")):
        with pytest.raises(LockFileRefused, match=why):
            RunFolderLock(str(run_dir), "megagspo train").acquire()
    assert (tmp_path / "other.txt").read_text() == "other\n"


def test_plain_lock_file_still_locks(tmp_path):
    from megagspo.checkpoint.run_lock import LOCK_FILE, RunFolderLock

    with RunFolderLock(str(tmp_path), "megagspo train"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with RunFolderLock(str(tmp_path), "megagspo train"):  # taken again over the previous owner's record
        pass


def test_trainer_on_a_symlinked_lock_exits_with_one_line(tmp_path):
    from megagspo.checkpoint.run_lock import LOCK_FILE

    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    run_dir = tmp_path / "out" / "r"
    run_dir.mkdir(parents=True)
    os.symlink(target, run_dir / LOCK_FILE)
    env = cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megagspo.cli", "train", *TINY, "name=r",
                           f"log.out_dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and f"{run_dir / LOCK_FILE} is a symbolic link" in proc.stderr
    assert target.read_text() == "precious\n" and sorted(os.listdir(run_dir)) == [LOCK_FILE]


# ------------------------------------------------------------------------------ §5 run names and messages
def _cli(capsys, *args):
    from megagspo.cli import main

    rc = main(["train", *TINY, *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("name", ["..", "../../x", "<absolute>", "", ".", "a/b"])
def test_run_name_that_is_not_one_folder_name_is_refused(tmp_path, capsys, name):
    out = tmp_path / "deep" / "out"
    out.mkdir(parents=True)
    name = str(tmp_path / "abs_run") if name == "<absolute>" else name
    rc, err = _cli(capsys, f"name={name}", f"log.out_dir={out}")
    assert rc == 2 and "Traceback" not in err
    assert "a run name is one plain folder name: not empty, not '.' or '..', no '/'" in err
    assert os.listdir(out) == [] and sorted(os.listdir(tmp_path)) == ["deep"]  # nothing written anywhere


def test_plain_run_names_pass():
    from megagspo.config import load_config

    for name in ("seed0", "run-1.b", "x..y"):
        assert load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), [f"name={name}"]).name == name


def test_unencodable_10mb_prompt_is_named_not_echoed(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "12+34=", "answer": "46"}] * 60 + [{"prompt": "1" * 10_000_000 + "\u00e9", "answer": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err = _cli(capsys, "data.task=file", f"data.train_path={data}", "data.max_prompt_tokens=20000000",
                   f"log.out_dir={tmp_path / 'out'}")
    assert rc == 2 and "Traceback" not in err
    assert "cannot encode character '\u00e9' (first at character 10000000)" in err
    assert "(10000001 characters)" in err and len(err) < 2000


def test_every_held_out_prompt_over_the_limit_says_how_many_and_which_limit(tmp_path, capsys):
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n" for _ in range(60)))
    held.write_text("".join(json.dumps({"prompt": "1+2=" * 10, "answer": "3"}) + "\n" for _ in range(5)))
    rc, err = _cli(capsys, "data.task=file", f"data.train_path={train}", f"data.eval_path={held}",
                   "data.max_prompt_tokens=8", "data.drop_long_prompts=true", f"log.out_dir={tmp_path / 'out'}")
    assert rc == 2 and "Traceback" not in err
    assert "no usable prompts: all 5 prompts are longer than data.max_prompt_tokens = 8" in err
