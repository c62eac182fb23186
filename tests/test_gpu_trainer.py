"""The tiny recipe end to end on one GPU (marked `gpu`: skipped on hosts without CUDA), through the same
`megagspo train` command a user runs: cold-start SFT, a few RL steps with Megatron's DDP and distributed
optimizer on CUDA, the embedded engine fed the weights bucket by bucket, checkpoints, and a resume that
continues the run. Cases: fp32 and bf16 GSPO; bf16 GSPO through the fused CUDA loss kernel
(`rl.loss_impl=kernels`); bf16 GRPO with R2 routing replay (routes recorded on CUDA and replayed); bf16 GSPO
with the rollout producer process at staleness 2, partial rollouts and R3 (two processes on one GPU).

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


def _report(name: str, doc: dict) -> None:
    """tools/gpu_check.sh's stages name a folder (MEGAGSPO_GPU_REPORT) where a run's figures go as <name>.json, for
    the verdict table (tools/gpu_goals.py)."""
    folder = os.environ.get("MEGAGSPO_GPU_REPORT")
    if folder:
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(doc, f, indent=1)


def _rl_figures(rows) -> dict:
    """What a GPU window records of a run: RL tokens per second (median over the steps after the first, which
    compiles and warms the allocator) and the processes' peak memory over the run."""
    rl = [r for r in rows if r.get("phase") == "rl"]
    later = sorted(r["throughput/tokens_per_s"] for r in rl[1:]) or [rl[0]["throughput/tokens_per_s"]]
    peaks = {key: max(r[key] for r in rl) for key in ("memory/trainer_peak_gib", "memory/producer_peak_gib")
             if all(key in r for r in rl)}
    return {"steps": len(rl), "tokens_per_s": later[len(later) // 2], **peaks}


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
    _report(f"tiny-{precision}", _rl_figures(rows))


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


@pytest.mark.gpu
def test_producer_with_partial_rollouts_and_r3_on_cuda(tmp_path):
    """rollout.staleness = 2 in the producer process, with partial rollouts and R3: the producer owns a CUDA engine
    beside the trainer's model on the same GPU, receives the weights by version while it generates, and hands over
    its responses' routes, which the update replays. Every consumed token is at most 2 versions old, and both
    processes' peak memory is logged on every step (recorded for the GPU window's table)."""
    rows, summary = _train(tmp_path, "producer", "model.precision=bf16", "rollout.staleness=2",
                           "rollout.partial=true", "rl.routing_replay=r3")
    _check_trained(tmp_path, "producer", rows, summary, "bf16")
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert all(r["rollout/staleness_max"] <= min(r["step"], 2) for r in rl), [r["rollout/staleness_max"] for r in rl]
    for r in rl:
        # each process holds a model on the GPU: more than a few MiB reserved, less than the device
        assert 0.001 < r["memory/trainer_peak_gib"] < 200 and 0.001 < r["memory/producer_peak_gib"] < 200, r
    _report("producer", _rl_figures(rows))
