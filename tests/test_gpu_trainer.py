"""The tiny recipe end to end on one GPU (marked `gpu`: skipped on hosts without CUDA), through the same
`megagspo train` command a user runs: cold-start SFT, a few RL steps with Megatron's DDP and distributed
optimizer on CUDA, the embedded engine fed the weights bucket by bucket, checkpoints, and a resume that
continues the run. Cases: fp32 and bf16 GSPO; bf16 GSPO through the fused CUDA loss kernel
(`rl.loss_impl=kernels`); bf16 GRPO with R2 routing replay (routes recorded on CUDA and replayed).

What is asserted is what the GPU is responsible for: the SFT loss falls, every RL metric is finite with a
non-zero gradient, the engine generated from the synced weights (responses of non-zero length), checkpoints were
written. Not the held-out accuracy after the short cold start: at 60 SFT steps the tiny model is often still on
its plateau (accuracy 0 on 64 problems about half the time, whatever the device), so that number says nothing
about CUDA. The CPU equivalents of every check, with exact values, run in CI (test_train_short.py,
test_checkpoint_resume.py, test_precision.py, test_routing_replay.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import REPO

ARGS = ["sft.steps=60", "rl.steps=4", "rl.eval_every=2", "data.eval_size=64",
        "rl.eval_samples=0", "log.progress=false", "log.plots=false", "log.tensorboard=false",
        "checkpoint.every_steps=2"]
RL_FINITE = ("loss", "grad_norm", "reward/mean", "ratio/mean", "entropy/mean", "kl/approx_old", "clip/seq_frac",
             "moe/expert_volatility")


def _train(tmp_path, name, *extra, config="configs/tiny_cpu.yaml"):
    env = dict(os.environ, MEGAGSPO_DEVICE="cuda", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megagspo.cli", "train", "--config", config, *ARGS, f"log.out_dir={tmp_path}", f"name={name}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(tmp_path, name, "summary.json")) as f:
        return rows, json.load(f)


def _check_trained(tmp_path, name, rows, summary, precision):
    assert summary["device"].startswith("cuda") and summary["precision"] == precision
    sft = [r["sft/loss"] for r in rows if r.get("phase") == "sft"]
    assert sft[-1] < 0.7 * sft[0], f"SFT loss did not fall: {sft}"
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    for r in rl:
        assert all(math.isfinite(r[k]) for k in RL_FINITE), r
        assert r["grad_norm"] > 0, r
        # the engine generated from the weights synced into it
        assert r["response/length_mean"] > 0, r
        assert 0.0 <= r["eval/accuracy"] <= 1.0, r
    assert 0.0 <= summary["cold_start/accuracy"] <= 1.0 and 0.0 <= summary["final/accuracy"] <= 1.0, summary
    steps = sorted(d for d in os.listdir(os.path.join(tmp_path, name, "checkpoints")) if d.startswith("step_"))
    assert steps, "no checkpoint written"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_recipe_trains_on_cuda(tmp_path, precision):
    rows, summary = _train(tmp_path, precision, f"model.precision={precision}")
    _check_trained(tmp_path, precision, rows, summary, precision)


@pytest.mark.gpu
def test_tiny_recipe_fused_gspo_loss_on_cuda(tmp_path):
    """rl.loss_impl=kernels: the GSPO loss by the segmented CUDA kernel (megagspo._C built with CUDA)."""
    rows, summary = _train(tmp_path, "kernels", "model.precision=bf16", "rl.loss_impl=kernels")
    _check_trained(tmp_path, "kernels", rows, summary, "bf16")


@pytest.mark.gpu
def test_tiny_recipe_grpo_r2_on_cuda(tmp_path):
    """GRPO with R2 routing replay (the shipped baseline recipe): the old policy's routes recorded on CUDA and
    replayed in the update."""
    rows, summary = _train(tmp_path, "grpo_r2", "model.precision=bf16", config="configs/tiny_cpu_grpo_r2.yaml")
    _check_trained(tmp_path, "grpo_r2", rows, summary, "bf16")


@pytest.mark.gpu
def test_bf16_run_resumed_on_cuda_continues(tmp_path):
    """Stopped after RL step 2 (checkpoint with the distributed optimizer's fp32 masters and moments, and the
    GPU generator), resumed with --resume: the rows up to the checkpoint are the cut run's, steps 2-3 follow
    from the checkpoint. The CPU suite asserts that a resume replays the uninterrupted run bit for bit; on CUDA
    the MoE token unpermutation's scatter-add is not deterministic, so two uninterrupted runs can already
    differ in the last bits and only continuation is asserted here."""
    cut, _ = _train(tmp_path, "cut", "model.precision=bf16", "rl.steps=2")
    resumed, summary = _train(tmp_path, "cut", "model.precision=bf16", "rl.steps=4", "--resume")
    assert resumed[:len(cut)] == cut
    rl = [r for r in resumed if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rl[2:])
    assert summary["device"].startswith("cuda") and summary["precision"] == "bf16"
