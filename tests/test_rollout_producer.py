"""The rollout producer process (rollout.staleness = N, rollout.producer = process; megagspo.rl.producer), end to end
with real `megagspo train` subprocesses on the tiny recipe:

- every consumed token was sampled exactly min(step, N) versions before the update that consumes it, and the queue
  never holds more than N batches;
- N = 1 logs the metrics of the one-step-ahead thread (rollout.producer = thread), bit for bit;
- a run killed mid-way and resumed logs the uninterrupted run's metrics at N = 2 (N = 1:
  test_rollouts_ahead.py's resume test, which runs the producer by default);
- a producer killed mid-run is restarted from the state after the last batch received: the same metrics;
- faults (issue 49): the producer killed in each phase (generating, mid-frame, waiting for a slot, waiting for the
  weights) and ten times at seeded random moments: each kill ends in a restart or a clean stop within a bound, and
  every run that ends has the uninterrupted run's metrics; SIGTERM while a step waits on a dying producer and
  Ctrl-C to the process group while the producer imports stop at a checkpoint with one line;
- under TP = 2 (torchrun) one rank runs the producer and shares its batches.

The N = 2 runs use dynamic sampling (rl.filter.enabled), which the producer runs itself: the consumed groups are the
informative ones, drawn in rounds, and a resumed or restarted producer draws the same rounds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import CliRuns
from test_checkpoint_resume import (_assert_same_metrics, _env, _rl_steps_logged, _rows, _run, _served,
                                    _start_and_wait)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", "configs/tiny_cpu.yaml", "sft.steps=2", "sft.batch_size=8", "rl.steps=4",
        "rl.batch.prompts_per_step=4", "rl.batch.group_size=2", "rl.batch.mini_batches=1", "rl.eval.every=100",
        "rl.eval.samples=0", "data.train_size=60", "data.eval_size=4", "threads=1", "log.progress=false",
        "log.plots=false", "log.tensorboard=false", "log.save_checkpoint=false", "checkpoint.every_steps=1",
        "reward.name=digit_match"]  # partial credit: informative groups and a moving policy from the first step


def _cmd(out_dir, name, *extra):
    import sys

    return [sys.executable, "-m", "megagspo.cli", "train", *ARGS, f"log.out_dir={out_dir}", f"name={name}", *extra]


def _rl(run_dir):
    return [r for r in _rows(run_dir) if r.get("phase") == "rl"]


STALE2 = ["rollout.staleness=2", "rl.filter.enabled=true", "rl.filter.max_rounds=3"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's runs that are only read afterwards (each a `megagspo train`): a run costs its
    training, not a fresh start-up. The runs a test kills or signals have processes of their own."""
    runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def stale2(cli, tmp_path_factory):
    """The uninterrupted N = 2 run with dynamic sampling, with its timed rows (the volatile time/ entries kept)."""
    import json

    out = tmp_path_factory.mktemp("n2")
    _served(cli, _cmd(out, "ref", *STALE2))
    with open(out / "ref" / "metrics.jsonl") as f:
        timed = [json.loads(line) for line in f if line.strip()]
    return out / "ref", [r for r in timed if r.get("phase") == "rl"]


def test_versions_of_consumed_tokens_and_the_queue_bound(stale2):
    """Batch k comes from version max(k - 2, 0): the consumed tokens' staleness is 0, 1, 2, 2 (every token of a
    batch one version), and the producer never holds more than N = 2 batches ahead of the trainer."""
    _, rows = stale2
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/stale_token_frac"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(0 <= r["time/queue_depth"] <= 2 for r in rows), [r["time/queue_depth"] for r in rows]
    assert all(r["time/trainer_wait_s"] >= 0 and r["time/producer_idle_s"] >= 0 for r in rows)
    # both processes' peaks, each a resident set of a process holding torch and a model (the producer's engine)
    assert all(0.1 < r["memory/trainer_peak_gib"] < 1024 and 0.1 < r["memory/producer_peak_gib"] < 1024
               for r in rows), [(r["memory/trainer_peak_gib"], r["memory/producer_peak_gib"]) for r in rows]
    assert rows[1]["mismatch/abs_log_ratio"] > rows[0]["mismatch/abs_log_ratio"]  # stale batches, measured so


def test_dynamic_sampling_runs_in_the_producer(stale2):
    """The producer scores its samples and draws more rounds (at most rl.filter.max_rounds) until its share holds
    informative groups; what it hands over is those (G = 2: both advantages nonzero), and the fill after the last
    round when it fell short."""
    _, rows = stale2
    assert all(1 <= r["filter/rounds"] <= 3 for r in rows) and any(r["filter/rounds"] > 1 for r in rows)
    assert [r["reward/nonzero_adv_frac"] for r in rows] == [1.0 - r["filter/filled_frac"] for r in rows]


def test_partial_rollouts_run_in_the_producer_and_log_their_versions(cli, tmp_path):
    """rollout.partial: the producer loads weights that arrive mid-batch and continues its responses under them
    (where the switches fall depends on timing: tests/test_partial_rollouts.py pins them). What holds whatever the
    timing: no token older than N, versions only fresher than without partial rollouts, the partial metrics in
    [0, 1], and a checkpoint of its queue (per-token versions included) that a resume reads."""
    args = ["rollout.staleness=2", "rollout.partial=true"]
    proc = _start_and_wait(_cmd(tmp_path, "partial", *args), tmp_path / "partial", min_rl_rows=2)
    proc.send_signal(signal.SIGKILL)  # with the queue's batches (and their tokens' versions) in the checkpoint
    proc.communicate(timeout=30)
    out = _served(cli, _cmd(tmp_path, "partial", *args, "--resume"))
    assert "resuming from" in out.stdout
    rows = _rl(tmp_path / "partial")
    assert [r["step"] for r in rows][-1] == 3
    for r in rows:
        assert 0.0 <= r["rollout/staleness_max"] <= min(r["step"], 2)
        assert 0.0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"]
        # a token older than its response's newest version is older than this update's weights too
        assert 0.0 <= r["rollout/older_version_token_frac"] <= r["rollout/stale_token_frac"] <= 1.0
        assert 0.0 <= r["rollout/continued_response_frac"] <= 1.0


def test_partial_rollouts_on_the_thread_hand_the_weights_over(cli, tmp_path):
    """rollout.partial with the one-step-ahead thread (SGLang's path): the weights after each update go to the
    generating thread, or load after it when its batch was done first, so the engine enters every step holding
    them. Until a response is continued (timing: here generation is far shorter than the update), the run logs
    the metrics of the thread without partial rollouts, plus the version metrics."""
    one = ["rollout.staleness=1", "checkpoint.every_steps=0", "rl.steps=3", "rollout.producer=thread"]
    _served(cli, _cmd(tmp_path, "plain", *one))
    _served(cli, _cmd(tmp_path, "partial", *one, "rollout.partial=true"))
    plain, partial = _rl(tmp_path / "plain"), _rl(tmp_path / "partial")
    assert len(partial) == 3
    added = ("rollout/", "mismatch/abs_log_ratio_current_version", "mismatch/abs_log_ratio_older_version")
    for r, p in zip(plain, partial):
        assert 0.0 <= p["rollout/staleness_max"] <= min(p["step"], 1)
        assert p["rollout/older_version_token_frac"] <= p["rollout/stale_token_frac"]
        if p["rollout/continued_response_frac"] > 0:
            break  # later batches come from other weights
        assert p["rollout/staleness_mean"] == p["rollout/staleness_max"] == min(p["step"], 1)
        assert {k: v for k, v in p.items() if not k.startswith(added)} == r


def test_staleness_one_equals_the_one_step_ahead_thread(cli, tmp_path):
    one = ["rollout.staleness=1", "checkpoint.every_steps=0", "rl.steps=3"]
    _served(cli, _cmd(tmp_path, "thread", *one, "rollout.producer=thread"))
    _served(cli, _cmd(tmp_path, "process", *one, "rollout.producer=process"))
    thread, process = _rows(tmp_path / "thread"), _rows(tmp_path / "process")
    new = ("rollout/staleness_mean", "rollout/staleness_max", "rollout/stale_token_frac")
    assert [r.get("rollout/staleness_max") for r in process if r["phase"] == "rl"] == [0.0, 1.0, 1.0]
    assert [{k: v for k, v in r.items() if k not in new} for r in process] == thread


def test_killed_and_resumed_at_staleness_two_equals_uninterrupted(cli, tmp_path, stale2):
    """The checkpoint after step n holds the batches generated with versions older than n (the queue) and the
    producer's state after the last of them; the resumed producer continues from it with the checkpoint's weights."""
    proc = _start_and_wait(_cmd(tmp_path, "k", *STALE2), tmp_path / "k", min_rl_rows=2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    out = _served(cli, _cmd(tmp_path, "k", *STALE2, "--resume"))
    assert "resuming from" in out.stdout
    _assert_same_metrics(stale2[0], tmp_path / "k")


def _producer_pid(trainer_pid: int):
    """The trainer's spawned producer (not multiprocessing's resource tracker), or None while there is none."""
    children = set()
    for tid in os.listdir(f"/proc/{trainer_pid}/task"):
        with open(f"/proc/{trainer_pid}/task/{tid}/children") as f:
            children.update(int(p) for p in f.read().split())
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return pid
    return None


def test_a_killed_producer_is_restarted_without_losing_or_repeating_a_sample(tmp_path, stale2):
    import subprocess

    proc = subprocess.Popen(_cmd(tmp_path, "p", *STALE2), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not _rl_steps_logged(tmp_path / "p"):  # the producer is running (making batch 2 or later)
        assert proc.poll() is None and time.time() - t0 < 180, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    pid = _producer_pid(proc.pid)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout producer died" in out, out
    _assert_same_metrics(stale2[0], tmp_path / "p")


@pytest.mark.multiprocess
def test_tensor_parallel_ranks_share_one_producer(tmp_path):
    """TP = 2 under torchrun (2 gloo processes): model-parallel rank 0 runs the producer and shares each batch
    with its peer (both train on it: the TP forward needs the same tokens on both), the weights stream to the
    producer through the TP gather, and the N = 2 versions, dynamic sampling and the checkpoint's wait all hold
    (the DP = 2 layout, one producer per rank, takes the same path with dp_rank's share)."""
    import sys

    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
          "megagspo.cli", "train", *ARGS, *STALE2, "parallel.tensor_parallel=2", "checkpoint.every_steps=2",
          f"log.out_dir={tmp_path}", "name=tp2"], timeout=300)
    rows = _rl(tmp_path / "tp2")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert all(1 <= r["filter/rounds"] <= 3 for r in rows)
    assert [r["reward/nonzero_adv_frac"] for r in rows] == [1.0 - r["filter/filled_frac"] for r in rows]


def test_a_producer_that_fails_by_itself_is_an_error_not_a_restart_loop():
    """A producer that dies on its own (here: its engine cannot be built) is restarted MAX_RESTARTS times, then the
    trainer's wait raises, naming the batch and the exit code."""
    from megagspo.data.datasets import PromptDataset
    from megagspo.config import RolloutConfig
    from megagspo.config_training import FilterConfig, RLBatchConfig
    from megagspo.rl.producer import EngineRecipe, ProducerSpec, RewardRecipe
    from megagspo.rl.producer_process import ProducerProcess
    from megagspo.rollout import SamplingParams
    from moe.parallel import DPShare

    spec = ProducerSpec(engine=EngineRecipe("no_such_engine", None, None), reward=RewardRecipe("exact_match", 0),
                        batch=RLBatchConfig(prompts_per_step=2, group_size=2, mini_batches=1),
                        filter=FilterConfig(), rollout=RolloutConfig(staleness=1), sampling=SamplingParams(4),
                        seed=0, steps=2, share=DPShare(0, 1))
    said = []
    producer = ProducerProcess(spec, PromptDataset([]), say=said.append)
    producer.MAX_RESTARTS = 1
    producer.start({"next": 0, "floor": 0, "dataset": None, "generator": None})
    try:
        with pytest.raises(RuntimeError, match=r"died 2 times in a row at batch 0 \(last exit code 1"):
            producer.take(0)
    finally:
        producer.close()
    assert len(said) == 1 and "restarted at batch 0" in said[0]


def _as_filed_by_ec55d2c(step_dir) -> None:
    """Rewrite a checkpoint's producer state the way ec55d2c filed it: under trainer_state.json["rollouts_ahead"]
    and rollouts_ahead.safetensors (the same metas and tensors: the format did not change, only its key), with the
    manifest's sizes and checksums to match."""
    import json

    from megagspo.checkpoint.store import sha256_file

    state_path = step_dir / "trainer_state.json"
    state = json.loads(state_path.read_text())
    assert "rollouts_ahead" not in state and state["producer"][0]["kind"] == "producer"
    state["rollouts_ahead"] = state.pop("producer")
    state_path.write_text(json.dumps(state))
    os.rename(step_dir / "producer.safetensors", step_dir / "rollouts_ahead.safetensors")
    manifest = json.loads((step_dir / "manifest.json").read_text())
    files = manifest["files"]
    del files["producer.safetensors"]
    for name in ("rollouts_ahead.safetensors", "trainer_state.json"):
        files[name] = {"bytes": os.path.getsize(step_dir / name), "sha256": sha256_file(step_dir / name)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_producer_checkpoint_filed_by_ec55d2c_still_resumes_exactly(cli, tmp_path, stale2):
    """The producer's state has a key of its own ("producer"); a checkpoint written by ec55d2c, which filed it under
    the one-step-ahead thread's key, resumes through the part's legacy key and logs the uninterrupted run's
    metrics."""
    import shutil

    ref_dir = stale2[0]
    step_dir = tmp_path / "step_000002"
    shutil.copytree(ref_dir / "checkpoints" / "step_000002", step_dir)
    _as_filed_by_ec55d2c(step_dir)
    out = _served(cli, _cmd(tmp_path, "legacy", *STALE2, f"checkpoint.resume={step_dir}"))
    assert "resuming from" in out.stdout and "not a bit-for-bit replay" not in out.stdout
    _assert_same_metrics(ref_dir, tmp_path / "legacy")


def test_under_the_producer_a_step_streams_the_model_once(tmp_path, monkeypatch):
    """With rollout.producer = process the weights after an update go to the producer only; the trainer's own engine
    is marked behind and gets them when the held-out evaluation reads it. Counted per step, in bytes: ec55d2c also
    streamed the whole model to the trainer's engine after every update."""
    from megagspo.config import load_config
    from megagspo.policy.engine_link import CopiedWeights, EngineLink
    from megagspo.trainer.trainer import Trainer

    streams = []  # (consumer kind, bytes) of every stream
    real = EngineLink.stream_weights

    def counted(self, consumer):
        before = self.streamed_bytes
        seconds = real(self, consumer)
        streams.append(("producer" if isinstance(consumer, CopiedWeights) else "engine", self.streamed_bytes - before))
        return seconds

    monkeypatch.setattr(EngineLink, "stream_weights", counted)
    overrides = [a for a in ARGS if "=" in a] + [f"log.out_dir={tmp_path}", "name=once", "rl.steps=4",
                                                 "rollout.staleness=1", "rollout.producer=process", "rl.eval.every=2",
                                                 "checkpoint.every_steps=0"]
    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), overrides)
    trainer = Trainer(cfg, quiet=True)
    per_step, rl_start = [], []
    real_step = trainer.rl_step

    def step(k):
        start = len(streams)
        rl_start.append(start)
        row = real_step(k)
        per_step.append(streams[start:])
        return row

    trainer.rl_step = step
    trainer.train(rl=True)
    model_bytes = streams[0][1]
    assert model_bytes > 0 and all(b == model_bytes for _, b in streams)  # every stream is the whole model
    # the producer starts at step 0 (version 0) and is sent version k + 1 while a batch still needs it
    # (batch k needs version max(k - 1, 0): versions 1 and 2 for batches 2 and 3)
    assert [[kind for kind, _ in s] for s in per_step] == [["producer", "producer"], ["producer"], [], []]
    assert [sum(b for _, b in s) for s in per_step] == [2 * model_bytes, model_bytes, 0, 0]
    # the trainer's engine is streamed to only where the held-out evaluation reads it: after steps 2 and 4
    assert [kind for kind, _ in streams[rl_start[0]:]].count("engine") == 2 and not trainer.link.behind


# ------------------------------------------------------------------ faults: kills and signals (issue 49, items 1, 2)
DIED = "rollout producer died"
STOP_BOUND_S = 60  # a kill to its restart line or the run's stop line: a trainer mid-update notices at its next take


class _Watched:
    """A `megagspo train` run under a test's eye: its output lines as they come, and the producer's test hooks
    (megagspo.rl.producer's docstring): the trace of its phases, and a hold file that keeps it in one."""

    def __init__(self, tmp_path, name, *extra, resume=False):
        import subprocess
        import threading

        self.run_dir, self.trace, self.hold = tmp_path / name, tmp_path / f"{name}.trace", tmp_path / f"{name}.hold"
        self.hold.write_text("")
        env = _env()
        env.update(MEGAGSPO_PRODUCER_TEST_TRACE=str(self.trace), MEGAGSPO_PRODUCER_TEST_HOLD=str(self.hold))
        cmd = _cmd(tmp_path, name, *STALE2, *extra, *(["--resume"] if resume else []))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
                        for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    def events(self):
        """The producer's trace: (pid, phase, batch) in order."""
        try:
            lines = self.trace.read_text().splitlines()
        except OSError:
            return []
        return [(int(p), phase, int(k)) for p, phase, k in (line.split() for line in lines if line.count(" ") == 2)]

    def deaths(self):
        return [line for line in self.out if line.startswith(DIED)]

    def until(self, what, predicate, timeout):
        t0 = time.monotonic()
        while True:
            got = predicate()
            if got:
                return got
            assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s; " + self.tail()
            time.sleep(0.01)

    def finish(self, timeout=240):
        rc = self.proc.wait(timeout=timeout)
        for t in self.readers:
            t.join(timeout=10)
        return rc

    def tail(self):
        return f"stdout: {''.join(self.out)[-2000:]}\nstderr: {''.join(self.err)[-3000:]}"


@pytest.fixture
def watch(tmp_path):
    """Starts _Watched runs; one still running when the test ends (it failed) is killed, its producer with it."""
    made = []

    def start(name, *extra, resume=False):
        made.append(_Watched(tmp_path, name, *extra, resume=resume))
        return made[-1]

    yield start
    for watched in made:
        if watched.proc.poll() is None:
            watched.proc.kill()
            watched.proc.wait(timeout=30)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_producer_and_wait(watched, pid, phase_and_batch):
    """SIGKILL the producer `pid` (in `phase_and_batch`); the seconds until the trainer said so (restart line or the
    run's end), and that line; None when the producer had ended already."""
    before = len(watched.deaths())
    t0 = time.monotonic()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    watched.hold.write_text("")
    watched.until(f"the trainer's answer to the kill in {phase_and_batch}",
                  lambda: len(watched.deaths()) > before or watched.proc.poll() is not None, STOP_BOUND_S)
    seconds = time.monotonic() - t0
    assert not os.path.exists(f"/proc/{pid}"), f"the killed producer {pid} was not reaped"
    return seconds, (watched.deaths()[before:] or [""])[0]


def test_a_producer_killed_in_each_phase_is_restarted_and_the_run_is_exact(watch, stale2):
    """The producer SIGKILLed in each of its phases: generating (before its first batch), halfway through writing a
    batch into the pipe (the trainer has half of it: it waited in read() for good before), waiting for a free
    slot, and waiting for the weights. Each time the trainer says so within the bound, reaps it and restarts it
    from the state after the last batch it received; the run's metrics are the uninterrupted run's."""
    watched = watch("phases")
    times = {}
    for target in ("make 0", "send 1", "idle 2", "wait 3"):
        watched.hold.write_text(target)
        phase, k = target.split()
        pid = watched.until(f"the producer in {target}", lambda: next(
            (p for p, ph, b in reversed(watched.events()) if (ph, b) == (phase, int(k)) and _alive(p)), None), 180)
        times[target], line = _kill_producer_and_wait(watched, pid, target)
        assert "exit code -9 (SIGKILL)" in line and "nothing lost or repeated" in line, watched.tail()
        assert [e for e in watched.events() if e[0] == pid][-1][1:] == (phase, int(k))  # killed in that phase
    assert watched.finish() == 0, watched.tail()
    assert "Traceback" not in "".join(watched.err), watched.tail()
    print(f"kill -> restart line, seconds: {times}")
    _assert_same_metrics(stale2[0], watched.run_dir)


def test_ten_producer_kills_at_random_moments_each_end_in_a_restart_or_a_clean_stop(watch, stale2):
    """The kill loop: 10 SIGKILLs of the producer at random moments (seeded: a delay after each producer appears, so
    its start-up and imports are hit too). Each ends, within the bound, in a restart (the trainer's line), or at the
    fourth death in a row without a batch received in a clean stop (one line naming the batch and the exit code,
    exit 1; --resume continues it), or, where the producer had sent its last batch already, in nothing: the run
    ends as it would have. Every run that ends has the uninterrupted run's metrics (a run that ends before the 10th
    kill is followed by another)."""
    import random

    rng = random.Random(49)
    runs, outcomes, seen = 1, [], set()
    watched = watch("loop1")
    while len(outcomes) < 10:
        def producer():
            if watched.proc.poll() is not None:
                return True
            try:
                pid = _producer_pid(watched.proc.pid)
            except OSError:  # the trainer just ended: the next look says so
                return None
            return pid if pid not in seen | {None} else None

        pid = watched.until("a producer to kill", producer, 180)
        if pid is True:  # the run ended: its producer had made every batch
            assert watched.finish() == 0, watched.tail()
            _assert_same_metrics(stale2[0], watched.run_dir)
            runs += 1
            watched = watch(f"loop{runs}")
            continue
        seen.add(pid)
        time.sleep(rng.uniform(0.0, 3.0))
        if not _alive(pid):
            continue
        answer = _kill_producer_and_wait(watched, pid, f"kill {len(outcomes)}")
        if answer is None:
            continue
        seconds, line = answer
        if line:
            outcomes.append(("restart", round(seconds, 2)))
            continue
        rc = watched.finish()
        if rc == 0:
            outcomes.append(("nothing left to make", round(seconds, 2)))
            continue
        last = [ln for ln in watched.err if ln.strip()][-1]
        assert rc == 1 and "Traceback" not in "".join(watched.err), watched.tail()
        assert last.startswith("megagspo train: error: rollout producer: died 4 times in a row at batch ") and \
            "exit code -9 (SIGKILL)" in last and "--resume continues" in last, watched.tail()
        outcomes.append(("stop", round(seconds, 2)))
        watched = watch(f"loop{runs}", resume=True)
    assert watched.finish() == 0, watched.tail()
    print(f"{runs} run(s); kill outcomes (seconds to the trainer's line): {outcomes}")
    _assert_same_metrics(stale2[0], watched.run_dir)


def _megagspo_lines(err_lines):
    return [ln.rstrip("\n") for ln in err_lines if ln.startswith("megagspo")]


def test_sigterm_while_the_trainer_waits_on_a_dying_producer_checkpoints_and_exits_143(cli, tmp_path, watch,
                                                                                        stale2):
    """Step 1 waits for its batch with half of it received (the producer held mid-frame) when SIGTERM comes, then
    the producer is SIGKILLed: before, that wait never ended ("finishing the current step" and nothing more). Now
    the producer is restarted, the step finishes, the checkpoint is written: one stop line, exit 143; --resume
    logs the uninterrupted run's metrics. (No checkpoint is due before: with checkpoint.every_steps=1 the
    checkpoint after step 0 would itself wait for batch 1, the queue it holds.)"""
    watched = watch("term", "checkpoint.every_steps=0")
    watched.hold.write_text("send 1")
    pid = watched.until("the producer in send 1", lambda: next(
        (p for p, ph, b in reversed(watched.events()) if (ph, b) == ("send", 1) and _alive(p)), None), 180)
    watched.until("RL step 0 logged", lambda: _rl_steps_logged(watched.run_dir) == [0], 60)
    time.sleep(0.5)  # step 1 asks for its batch
    watched.proc.send_signal(signal.SIGTERM)
    watched.until("the trainer's stop line", lambda: any("received SIGTERM" in ln for ln in watched.err), 10)
    time.sleep(0.5)
    assert watched.proc.poll() is None  # still waiting for the batch: the step is not over
    _kill_producer_and_wait(watched, pid, "send 1")
    assert watched.finish(timeout=STOP_BOUND_S) == 143, watched.tail()
    lines = _megagspo_lines(watched.err)
    assert len(lines) == 2 and lines[0].startswith("megagspo: received SIGTERM: finishing the current step") and \
        lines[1].startswith("megagspo train: stopped by SIGTERM after RL step 2; checkpoint ") and \
        "step_000002 written; continue with --resume" in lines[1], watched.tail()
    assert "Traceback" not in "".join(watched.err) and len(watched.deaths()) == 1, watched.tail()
    _served(cli, _cmd(tmp_path, "term", *STALE2, "--resume"))
    _assert_same_metrics(stale2[0], watched.run_dir)


def test_ctrl_c_to_the_process_group_while_the_producer_imports_stops_at_a_checkpoint(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: here while the producer imports torch, with the full
    training set (its start message is ~300 KB). Before, the producer died mid-import with a KeyboardInterrupt
    traceback and the trainer hung in Process.start() writing its start payload; now the producer ignores it, the
    trainer finishes the step and checkpoints: one stop line, exit 130, no traceback."""
    import subprocess

    trace = tmp_path / "trace"
    env = dict(_env(), MEGAGSPO_PRODUCER_TEST_TRACE=str(trace))
    args = [a for a in _cmd(tmp_path, "int", *STALE2) if not a.startswith("data.train_size=")]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a process group of its own, as a terminal's job has

    def importing_torch():
        if proc.poll() is not None:
            return True
        try:
            pid = _producer_pid(proc.pid)
            with open(f"/proc/{pid}/maps") as f:
                return pid if "libtorch" in f.read() else None
        except OSError:  # none yet, or it just ended
            return None

    try:
        t0 = time.monotonic()
        while not (pid := importing_torch()):
            assert time.monotonic() - t0 < 180, "no producer started"
            time.sleep(0.005)
        assert pid is not True, proc.communicate()[1][-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        assert not trace.exists()  # the producer had not read its start message: it was still starting up
        out, err = proc.communicate(timeout=STOP_BOUND_S)  # ec55d2c: hung in Process.start(), its child a zombie
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    lines = _megagspo_lines(err.splitlines(keepends=True))
    assert len(lines) == 2 and lines[0].startswith("megagspo: received SIGINT: finishing the current step") and \
        lines[1].startswith("megagspo train: stopped by SIGINT after RL step 1; checkpoint "), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and DIED not in out, (out, err[-3000:])
    assert trace.read_text().split()[1:3] == ["start", "0"]  # the same producer went on to make batch 0
