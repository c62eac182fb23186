"""tools/gpu_check.sh (`make gpu-check`) in its dry mode, as CI runs it: on a host without CUDA it prints the whole
stage table with SKIP reasons, writes its summary files and exits 0 within a minute, so the script cannot rot
between GPU windows. The goal verdicts (tools/gpu_goals.py) are checked on benchmark JSON of the benches' format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO

SCRIPT = os.path.join(REPO, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(REPO, "tools"))
import gpu_goals  # noqa: E402


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path / "out"))
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="dry mode is the no-CUDA behaviour; on a GPU host the script runs for real")
def test_dry_mode_prints_the_whole_table_and_exits_0(tmp_path):
    start = time.monotonic()
    proc = _run(tmp_path)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seconds < 60, f"dry mode took {seconds:.0f} s"
    out = proc.stdout
    assert "dry mode" in out
    for stage in gpu_goals.STAGES:
        assert any(line.startswith(stage + " ") and "SKIP" in line for line in out.splitlines()), (stage, out)
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["dry"] is True and [s["stage"] for s in summary["stages"]] == gpu_goals.STAGES
    assert all(s["status"] == "SKIP" and s["note"] for s in summary["stages"])
    assert (tmp_path / "out" / "summary.txt").read_text().strip() in out
    assert (tmp_path / "out" / "logs.tgz").stat().st_size > 0


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    proc = _run(tmp_path, "--only", "stepp")
    assert proc.returncode == 2 and "unknown stage stepp" in proc.stderr
    proc = _run(tmp_path, "--budget", "soon")
    assert proc.returncode == 2 and "--budget" in proc.stderr
    assert not (tmp_path / "out").exists()


def _write(out, name, doc):
    out.mkdir(exist_ok=True)
    (out / name).write_text(json.dumps(doc))


def test_goal_verdicts_read_the_benchmarks_json(tmp_path):
    out = tmp_path / "o"
    _write(out, "step.json", {"micro_batches": 4, "results": [
        {"path": "grouped+sdpa", "micro_batches": 4, "fwd_bwd_tflops": 251.0, "fwd_bwd_ms_per_micro_batch": 59.3,
         "peak_gib": 41.0, "optimizer_ms": 80.0, "optimizer_share_k8": 0.144}]})
    _write(out, "logits.json", {"results": [
        {"path": "fused", "fwd_x_read": 1.02, "bwd_x_read_write": 1.41},
        {"path": "fused-inplace", "fwd_x_read": 1.01, "bwd_x_read_write": 1.12}],
        "gspo": {"ratio": 2.5, "kernel_ms": 0.05, "trivial_ms": 0.02}})
    _write(out, "hidden.json", {"results": [{"path": "hidden", "tflops": 500.0, "extra_gib": 0.9, "max_rel_err": 3e-3}]})
    step = gpu_goals.verdict_step(str(out))
    assert step["step"][1] == "met" and "251 TF/s" in step["step"][0]
    assert "14.4% of a k=8 step" in step["optimizer"][0]
    logits = gpu_goals.verdict_logits(str(out))
    assert logits["logits-fwd"][1] == "met" and logits["logits-bwd"][1] == "met"  # the better of the two paths
    assert logits["gspo"][1] == "missed by 1.25x"
    hidden = gpu_goals.verdict_hidden(str(out))["hidden"]
    assert hidden[1].startswith("missed: memory 1.38x the cap") and "speed" not in hidden[1]
    text = gpu_goals.summary(str(out), 470, 12, False)
    assert "step       met" in text and json.load(open(out / "summary.json"))["goals"]["gspo"]["verdict"] == "missed by 1.25x"
    # the trainer runs' figures (tests/test_gpu_trainer.py's _report): reported, with both processes' peaks
    _write(out, "producer.json", {"steps": 4, "tokens_per_s": 5321.4, "memory/trainer_peak_gib": 1.25,
                                  "memory/producer_peak_gib": 0.5})
    assert gpu_goals.verdict_run("producer", str(out)) == {"producer": (
        "5321 RL tokens/s (median of 4 steps), trainer peak 1.25 GiB, producer peak 0.50 GiB", "reported")}
    assert gpu_goals.verdict_run("tiny", str(out)) == {"tiny": ("no result", "missing")}
    # the thresholds: < 200 TF/s is "not done", >= 277 the stretch
    _write(out, "step.json", {"results": [{"path": "grouped+sdpa", "fwd_bwd_tflops": 190.0}]})
    assert gpu_goals.verdict_step(str(out))["step"][1] == "missed (< 200: not done)"
    _write(out, "step.json", {"results": [{"path": "grouped+sdpa", "fwd_bwd_tflops": 280.0}]})
    assert gpu_goals.verdict_step(str(out))["step"][1] == "met (stretch)"
    # an A/B path is shown against the default; the verdict stays the default's
    _write(out, "step.json", {"results": [{"path": "grouped+sdpa", "fwd_bwd_tflops": 180.0},
                                          {"path": "grouped+sdpa+triton", "fwd_bwd_tflops": 207.0},
                                          {"path": "grouped+sdpa+swiglu-fused", "error": "no triton"}]})
    ab = gpu_goals.verdict_step(str(out))["step"]
    assert ab[1] == "missed (< 200: not done)" and ab[0].endswith("; grouped+sdpa+triton 207 TF/s (1.15x), grouped+sdpa+swiglu-fused did not run"), ab


def test_a_missing_or_broken_result_costs_its_verdict_not_the_table(tmp_path):
    out = tmp_path / "o"
    _write(out, "hidden.json", {"results": [{"path": "hidden"}]})
    (out / "logits.json").write_text("{not json")
    text = gpu_goals.summary(str(out), 470, 3, False)
    for stage in gpu_goals.STAGES:
        assert f"\n{stage} " in text
    goals = json.load(open(out / "summary.json"))["goals"]
    assert goals["hidden"]["verdict"] == "missing" and goals["logits"]["verdict"] == "missing"


def test_the_trainer_end_to_end_runs_right_after_the_build(tmp_path):
    """A first GPU window learns within minutes whether a CUDA trainer run works: tiny-bf16 follows the build, the
    CPU-side contract on the host's own torch next, the benchmarks after; the script and the summary agree."""
    assert gpu_goals.STAGES[:5] == ["env", "install", "build", "tiny-bf16", "contract"]
    assert gpu_goals.STAGES.index("step") > gpu_goals.STAGES.index("t-model")
    listed = subprocess.run(["bash", SCRIPT, "--list"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert listed.stdout.split() == gpu_goals.STAGES
    script = open(SCRIPT).read()
    order = [script.index(f"run_stage {s} ") for s in gpu_goals.STAGES if f"run_stage {s} " in script]
    assert order == sorted(order), "run_stage calls must come in the table's order"
