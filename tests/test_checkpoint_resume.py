"""Runs that are killed and resumed (issue "Checkpoints that never lose a run"), on CPU with real
`megagspo train` subprocesses:

- SIGKILL mid-step, `--resume`: every metric of every step equals the uninterrupted run's (timings aside);
- SIGTERM: the current step finishes, a checkpoint is written on the signal, exit 143; resume equals;
- the newest checkpoint's model shard (a dist_checkpointing .distcp file) truncated: detected by the manifest,
  the run resumes from the previous one, saying which file was wrong (equal);
- a checkpoint written at EP=2 (2 gloo processes, one shard file per rank) resumes at EP=1, and the restored
  weights, fp32 master weights and Adam moments are exactly the saved ones.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import CliRuns
from multiprocess import cpu_pinned_env, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", "configs/tiny_cpu.yaml", "sft.steps=4", "sft.batch_size=16", "rl.steps=6",
        "rl.prompts_per_step=4", "rl.group_size=4", "rl.mini_batches=2", "rl.eval_every=2", "rl.eval_samples=1",
        "data.train_size=200", "data.eval_size=20", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", "threads=1", "checkpoint.every_steps=2",
        "reward.name=digit_match"]  # partial credit: nonzero advantages from step 0, so the policy really moves
# wall-clock and memory measurements differ between any two runs; everything else must be identical
VOLATILE = ("time/", "throughput/", "memory/")


def _env():
    env = cpu_pinned_env()  # CPU runs also on a GPU host (2 torchrun ranks cannot share one GPU under NCCL)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cmd(out_dir, name, *extra):
    return [sys.executable, "-m", "megagspo.cli", "train", *ARGS, f"log.out_dir={out_dir}", f"name={name}", *extra]


def _run(cmd, rc=0, timeout=240):
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == rc, f"{' '.join(cmd)} -> {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _rl_steps_logged(run_dir):
    try:
        return [r["step"] for r in _rows(run_dir) if r.get("phase") == "rl"]
    except (OSError, ValueError):
        return []


def _start_and_wait(cmd, run_dir, min_rl_rows, timeout=180):
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while len(_rl_steps_logged(run_dir)) < min_rl_rows:
        assert proc.poll() is None, f"run ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < timeout, "run too slow"
        time.sleep(0.05)
    return proc


def _assert_same_metrics(reference_dir, run_dir):
    ref, got = _rows(reference_dir), _rows(run_dir)
    assert [r.get("phase") for r in got] == [r.get("phase") for r in ref]
    for a, b in zip(ref, got):
        assert a == b, f"step {a.get('step')} ({a.get('phase')}) differs: " + str(
            {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's runs that are only read afterwards (each a `megagspo train`): a run costs its
    training, not a fresh start-up. The runs a test kills or signals have processes of their own."""
    runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _served(cli, cmd, rc=0, timeout=240):
    """_run's checks on a run made by `cli`."""
    proc = cli.run(cmd, timeout=timeout)
    assert proc.returncode == rc, f"{' '.join(cmd)} -> {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def uninterrupted(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    _served(cli, _cmd(out, "ref"))
    rows = _rows(out / "ref")
    assert len([r for r in rows if r["phase"] == "rl"]) == 6
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len({r["loss"] for r in rl}) > 1 and len({r["grad_norm"] for r in rl}) > 1  # the metrics do move
    return out / "ref"


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_equals_uninterrupted(cli, uninterrupted, tmp_path):
    run_dir = tmp_path / "k"
    proc = _start_and_wait(_cmd(tmp_path, "k"), run_dir, min_rl_rows=3)  # killed during step 3 (or 4)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.isdir(run_dir / "checkpoints" / "step_000002")
    assert not os.path.exists(run_dir / "checkpoints" / "step_000006")
    out = _served(cli, _cmd(tmp_path, "k", "--resume"))
    assert "resuming from" in out.stdout
    _assert_same_metrics(uninterrupted, run_dir)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_nonzero_and_resume_equals(cli, uninterrupted, tmp_path):
    run_dir = tmp_path / "t"
    # checkpoints only on the signal (and at the end / after SFT): the one found must come from SIGTERM
    proc = _start_and_wait(_cmd(tmp_path, "t", "checkpoint.every_steps=0"), run_dir, min_rl_rows=1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "received SIGTERM: finishing the current step" in err
    assert "stopped by SIGTERM after RL step" in err
    steps = [int(d.split("_")[1]) for d in os.listdir(run_dir / "checkpoints")]
    saved = max(steps)
    assert 1 <= saved < 6 and f"after RL step {saved};" in err
    assert _rl_steps_logged(run_dir) == list(range(saved))
    _served(cli, _cmd(tmp_path, "t", "checkpoint.every_steps=0", "--resume"))
    _assert_same_metrics(uninterrupted, run_dir)


@pytest.mark.slow
def test_truncated_newest_shard_falls_back_to_previous(cli, uninterrupted, tmp_path):
    run_dir = tmp_path / "ref"
    shutil.copytree(uninterrupted, run_dir)
    ckpts = run_dir / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step_000002", "step_000004", "step_000006"]  # keep_last = 3
    shard = ckpts / "step_000006" / "model" / "__0_0.distcp"
    os.truncate(shard, os.path.getsize(shard) // 2)
    out = _served(cli, _cmd(tmp_path, "ref", "--resume"))
    assert ("checkpoint step_000006 is corrupt (model/__0_0.distcp has" in out.stdout
            and "falling back to step_000004" in out.stdout), out.stdout
    assert "resuming from" in out.stdout and "step_000004" in out.stdout
    _assert_same_metrics(uninterrupted, run_dir)
    # the resumed run rewrote step 6 intact
    from megagspo.checkpoint import REQUIRED, verify

    assert verify(str(ckpts / "step_000006"), REQUIRED) is None


def _reload_body(rank, world_size, ckpt_dir, cfg_overrides):
    """At EP=1 (1 process): load a checkpoint written at EP=2 the way resume does; -> the full weights and
    the full distributed-optimizer state (under full names) as loaded."""
    import torch

    from megagspo.checkpoint.state import CheckpointManager, gather_optimizer_state
    from megagspo.config import load_config
    from megagspo.data import build_datasets
    from megagspo.policy.megatron_policy import MegatronPolicy, setup_parallel
    from moe.optimizer import OptimizerSettings

    cfg = load_config("configs/tiny_cpu.yaml", cfg_overrides)
    tok, _, _, _ = build_datasets(cfg.data)
    dims, _, _ = setup_parallel(cfg.parallel, seed=3)
    policy = MegatronPolicy(cfg.model.architecture(tok.vocab_size), dims, cfg.parallel)
    opt = policy.make_optimizer(OptimizerSettings(lr=1e-3))
    mgr = CheckpointManager(cfg, dims)
    point = {"path": ckpt_dir, "state": json.load(open(os.path.join(ckpt_dir, "trainer_state.json")))}
    mgr.load_model(policy, point)
    mgr.load_optimizer(policy, opt, point)
    return policy.full_state_dict(), gather_optimizer_state(policy, opt)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_from_ep2_resumes_at_ep1(cli, tmp_path):
    small = ["rl.steps=2", "checkpoint.every_steps=1"]
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
          "megagspo.cli", "train", *ARGS, *small, "parallel.expert_parallel=2", f"log.out_dir={tmp_path}",
          "name=ep"], timeout=300)
    ckpt = tmp_path / "ep" / "checkpoints" / "step_000002"
    state = json.load(open(ckpt / "trainer_state.json"))
    assert state["world"] == 2 and state["layout"]["expert_parallel"] == 2 and state["optimizer"]
    for part in ("model", "optimizer"):  # one torch_dist shard file per rank
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(ckpt / part))
    manifest = json.load(open(ckpt / "manifest.json"))
    assert {"model/__1_0.distcp", "optimizer/__1_0.distcp", "model/.metadata"} <= set(manifest["files"])
    from megagspo.checkpoint import load_run_checkpoint

    saved = load_run_checkpoint(str(ckpt))["state"]  # rebuilt from the shards in this process
    model, opt = run_distributed(_reload_body, world_size=1, timeout_s=180,
                                 args=(str(ckpt), ["data.train_size=200", "data.eval_size=20"]))[0]
    assert set(model) == set(saved) and all(torch.equal(model[k], v) for k, v in saved.items())
    assert len(opt) == 4 * len(saved)  # fp32 master weight, two moments, step
    for name, t in saved.items():  # fp32 run: the master weights are the weights
        assert torch.equal(opt[f"master/{name}"], t), name
    from moe.dist_checkpoint import read_full_state_dict

    for kind in ("exp_avg", "exp_avg_sq"):  # the moments as stored (both ranks' files), gathered in this process
        index = {n: {"key": f"optimizer.state.{kind}.{w['key']}", "offset": w["offset"]}
                 for n, w in state["model_index"].items()}
        stored = read_full_state_dict(str(ckpt / "optimizer"), index)
        assert all(torch.equal(opt[f"{kind}/{n}"], t) for n, t in stored.items())
    out = _served(cli, _cmd(tmp_path, "ep", "rl.steps=3", "--resume"))  # 1 process, EP=1
    assert "resumed on 1" in out.stdout
    rl = [r for r in _rows(tmp_path / "ep") if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
