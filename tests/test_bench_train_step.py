"""benchmarks/bench_train_step.py: k micro-batches per optimizer step, fwd+bwd and optimizer timed apart, --json
and --profile, on the CPU at tiny shapes; the profile summary's CUDA branch on synthetic device events."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from multiprocess import cpu_pinned_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_train_step.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_on_cpu_writes_json_and_profile(tmp_path):
    out_json, prof_dir = tmp_path / "step.json", tmp_path / "prof"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--dtype", "float32", "--hidden", "64", "--experts", "4",
           "--topk", "2", "--moe-ffn", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layers", "1",
           "--vocab", "64", "--micro-batch", "1", "--seq", "16", "--micro-batches", "2", "--warmup", "1",
           "--steps", "1", "--json", str(out_json), "--profile", str(prof_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_pinned_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = re.search(r"^grouped\+sdpa fwd\+bwd: ([\d.e+-]+) ms/micro-batch, ([\d.e+-]+) TFLOP/s; optimizer: "
                     r"([\d.e+-]+) ms/step \(share at k=8: ([\d.]+)%\); step: ([\d.e+-]+) ms, ([\d.e+-]+) TFLOP/s "
                     r"at k=2; peak ([\d.]+) GiB$", proc.stdout, re.M)
    assert line, proc.stdout
    table_row = next(row for row in proc.stdout.splitlines() if row.startswith("grouped+sdpa "))
    facts = json.loads(out_json.read_text())
    assert facts["micro_batches"] == 2 and facts["tokens_per_micro_batch"] == 16 and facts["dtype"] == "float32"
    assert facts["arch"]["hidden"] == 64 and facts["torch"] and facts["device"].startswith("cpu")
    (result,) = facts["results"]
    assert result["path"] == "grouped+sdpa"
    # tools/gpu_goals.py reads these keys
    assert float(table_row.split()[3]) == pytest.approx(result["fwd_bwd_tflops"], rel=1e-3)
    assert result["fwd_bwd_ms_per_micro_batch"] == pytest.approx(result["fwd_bwd_ms_per_step"] / 2)
    assert result["optimizer_share_k8"] == pytest.approx(
        result["optimizer_ms"] / (8 * result["fwd_bwd_ms_per_micro_batch"] + result["optimizer_ms"]))
    assert result["step_tflops"] < result["fwd_bwd_tflops"] and result["micro_batches"] == 2
    assert result["peak_gib"] > 0 and result["loss"] == result["loss"]
    profile = result["profile"]
    assert 0 < len(profile["top"]) <= 10
    assert sum(profile["class_share"].values()) == pytest.approx(1.0)
    assert profile["share_outside_matmul_attention"] == profile["class_share"]["other"]
    assert profile["class_share"]["matmul"] > 0
    assert os.path.exists(profile["table"]) and "outside matmul and attention" in proc.stdout
    assert profile["trace"] and os.path.getsize(profile["trace"]) < 20 * 10**6


def test_kernel_classes():
    classify = _bench().classify_kernel
    assert classify("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>") == "attention"
    assert classify("fmha_cutlassB_bf16_aligned_64x64_k128_sm80") == "attention"  # attention before cutlass
    assert classify("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "matmul"
    assert classify("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<...>>") == "matmul"
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert classify("aten::mm") == "matmul" and classify("aten::_grouped_mm") == "matmul"
    assert classify("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "other"
    assert classify("Memcpy DtoH (Device -> Pageable)") == "other"
    assert classify("aten::mul") == "other" and classify("aten::addcmul_") == "other"


def test_profile_summary_on_device_events():
    """The CUDA branch: device events timed per name, GPU annotation ranges (named like a CPU range) not counted,
    device time split at the optimizer range's start."""
    from torch.autograd import DeviceType

    def event(name, device, start, end):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_async=False, is_user_annotation=False, self_cpu_time_total=0)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [event("bench::fwd_bwd", cpu, 0, 100), event("bench::optimizer", cpu, 100, 200),
              event("bench::fwd_bwd", gpu, 5, 95), event("Optimizer.step#AdamW.step", cpu, 120, 190),
              event("Optimizer.step#AdamW.step", gpu, 125, 185),
              event("nvjet_tst_gemm", gpu, 10, 50), event("flash_fwd_kernel", gpu, 50, 70),
              event("elementwise_kernel", gpu, 70, 80), event("multi_tensor_apply_kernel", gpu, 130, 160)]
    summary = _bench().summarize_profile(events, on_device=True)
    assert summary["total_ms"] == pytest.approx(0.1)  # 40 + 20 + 10 + 30 us
    assert summary["wall_ms"] == pytest.approx(0.2) and summary["device_busy_share"] == pytest.approx(0.5)
    assert summary["phase_ms"] == pytest.approx({"fwd_bwd": 0.07, "optimizer": 0.03})
    assert summary["class_share"] == pytest.approx({"matmul": 0.4, "attention": 0.2, "other": 0.4})
    assert [row["name"] for row in summary["top"]] == ["nvjet_tst_gemm", "multi_tensor_apply_kernel",
                                                       "flash_fwd_kernel", "elementwise_kernel"]
