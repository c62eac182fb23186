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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
