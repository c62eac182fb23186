"""End-to-end: short `megagspo train` runs (1 process and 2 gloo processes under torchrun, DP=2 and EP=2),
the metrics JSONL holds every promised field with finite values, plots and checkpoint are written, and
the Megatron -> HF weight export makes both engines compute the same logits (on the CPU and, marked gpu, with
both engines on CUDA: `test_weight_export_matches_megatron[cuda]`)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from devices import DEVICES, child_env
from helpers import CliRuns
from multiprocess import cpu_pinned_env, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every RL row must carry these (issue §6), finite.
FIELDS = [
    "reward/mean", "reward/accuracy", "reward/errors", "eval/accuracy", "eval/sampled_accuracy", "response/length_mean",
    "clip/seq_frac", "clip/tok_frac", "clip/seq_low_frac", "clip/seq_high_frac", "kl/approx_old", "entropy/mean",
    "moe/expert_volatility", "grad_norm", "lr", "loss", "ratio/mean", "throughput/tokens_per_s",
    "time/rollout_s", "time/reward_s", "time/old_logp_s", "time/train_s", "time/sync_s", "time/eval_s", "time/step_s",
    "memory/trainer_peak_gib",
]

SHORT = ["sft.steps=4", "sft.batch_size=16", "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4",
         "rl.mini_batches=2", "rl.eval_every=2", "data.train_size=200", "data.eval_size=20", "log.progress=false"]


def _env():
    env = cpu_pinned_env()  # CPU runs also on a GPU host (2 torchrun ranks cannot share one GPU under NCCL)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd, timeout=240):
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's single-process `megagspo` runs: a run costs its work, not a fresh start-up."""
    runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _served(cli, cmd, timeout=240):
    """_run's check on a run made by `cli`."""
    proc = cli.run(cmd, timeout=timeout)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _check_run(run_dir, steps):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == steps
    for row in rl:
        missing = [f for f in FIELDS if f not in row]
        assert not missing, f"metrics row lacks {missing}"
        bad = {k: v for k, v in row.items() if not isinstance(v, str) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics {bad}"
        assert 0.0 <= row["reward/mean"] <= 1.0 and 0.0 <= row["eval/accuracy"] <= 1.0
        # a process holding torch, Megatron and a model has a resident set of well over 100 MiB; below 1 TiB
        assert 0.1 < row["memory/trainer_peak_gib"] < 1024, row["memory/trainer_peak_gib"]
    assert any(r["phase"] == "cold_start" for r in rows)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert "cold_start/accuracy" in summary and "final/accuracy" in summary
    for png in ("reward_accuracy.png", "clip_fraction.png", "expert_volatility.png"):
        assert os.path.getsize(os.path.join(run_dir, png)) > 0
    return rows, summary


@pytest.mark.slow
def test_short_train_run_and_export(cli, tmp_path):
    _served(cli, [sys.executable, "-m", "megagspo.cli", "train", "--config", "configs/tiny_cpu.yaml", *SHORT,
                  "threads=1", "name=short", f"log.out_dir={tmp_path}"])
    _check_run(tmp_path / "short", 3)
    out = _served(cli, [sys.executable, "-m", "megagspo.cli", "export", "--checkpoint", str(tmp_path / "short")])
    assert os.path.isfile(tmp_path / "short" / "hf" / "config.json"), out.stdout


@pytest.mark.slow
def test_short_run_grpo_with_r2_replay_and_rollout_old_logp(cli, tmp_path):
    _served(cli, [sys.executable, "-m", "megagspo.cli", "train", "--config", "configs/tiny_cpu.yaml", *SHORT,
                  "threads=1", "rl.steps=2", "rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.28",
                  "rl.routing_replay=r2", "name=a", f"log.out_dir={tmp_path}"])
    rows, _ = _check_run(tmp_path / "a", 2)
    # R2 replays pi_old's routes: the training forward uses exactly pi_old's experts.
    _served(cli, [sys.executable, "-m", "megagspo.cli", "train", "--config", "configs/tiny_cpu.yaml", *SHORT,
                  "threads=1", "rl.steps=2", "rl.loss=gspo_token", "rl.old_logp=rollout", "name=b",
                  f"log.out_dir={tmp_path}"])
    _check_run(tmp_path / "b", 2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", [[], ["parallel.expert_parallel=2"], ["parallel.pipeline_parallel=2"]],
                         ids=["dp2", "dp2_ep2", "pp2"])
def test_torchrun_two_processes(tmp_path, parallel):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          "-m", "megagspo.cli", "train", "--config", "configs/tiny_cpu.yaml", *SHORT, *parallel, "threads=1",
          "rl.steps=2", "name=tr", f"log.out_dir={tmp_path}"], timeout=300)
    _check_run(tmp_path / "tr", 2)


def test_bad_input_fails_before_compute(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megagspo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                           "data.task=file", f"data.train_path={tmp_path}/missing.jsonl"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "data.train_path" in proc.stderr and "no such file" in proc.stderr
    assert not os.path.exists(os.path.join(REPO, "runs", "tiny_cpu", "never"))


def _parity_body(rank, world_size):
    from megagspo.config import load_config
    from megagspo.data import build_datasets
    from megagspo.rollout import HFRolloutEngine, SamplingParams
    from megagspo.policy.megatron_policy import MegatronPolicy, build_sequences, setup_parallel
    from moe.model import forward_logits

    cfg = load_config("configs/tiny_cpu.yaml", ["data.train_size=50", "data.eval_size=5"])
    tok, train, _, _ = build_datasets(cfg.data)
    layout, _, _ = setup_parallel(cfg.parallel, seed=5)
    arch = cfg.model.architecture(tok.vocab_size)
    policy = MegatronPolicy(arch, layout, cfg.parallel)
    engine = HFRolloutEngine(arch, tok)
    engine.update_weights(policy.full_state_dict())
    device = policy.device  # the CPU, or the GPU in the cuda variant (the engine follows moe.device too)
    x = torch.randint(0, tok.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        mega = forward_logits(policy.model, x)
        hf = engine.model(input_ids=x).logits
        out = engine.generate([ex.prompt_ids for ex in train[:3]], 2, SamplingParams(5))
        inp, tgt, mask, pos = build_sequences(out.prompt_ids, out.response_ids_RL, out.response_mask_RL, tok.pad_id)
        lp, _ = policy.token_logprobs(inp.to(device), tgt.to(device))
    devices = (mega.device.type, hf.device.type, lp.device.type)
    return mega, hf, lp.gather(1, pos.to(lp.device)), out.logp_RL, out.response_mask_RL, devices


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DEVICES)
def test_weight_export_matches_megatron(device):
    mega, hf, lp_mega, lp_engine, mask, devices = run_distributed(_parity_body, world_size=1, timeout_s=180,
                                                                  env=child_env(device))[0]
    assert devices == (device,) * 3, devices
    # CUDA: 1e-4 instead of 1e-5. Both engines run float32 on the GPU, but the MoE unpermute's scatter-add uses
    # atomics (run-dependent summation order), HF's SDPA takes a fused CUDA kernel with its own accumulation
    # order, and the policy's log-probs come from the CUDA log-prob kernel (built with --use_fast_math: exp/log
    # a few ulp off) where the engine uses torch's log_softmax. TF32 is off (torch's default).
    tol = 1e-4 if device == "cuda" else 1e-5
    torch.testing.assert_close(hf, mega, rtol=tol, atol=tol)
    torch.testing.assert_close(lp_engine[mask], lp_mega[mask], rtol=tol, atol=tol)
