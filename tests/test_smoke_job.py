"""`python -m moe.smoke` (`make smoke`): a tiny Megatron MoE model memorises one batch on the device the host has;
on a GPU host the model, its RNG and its tokens are on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO
from multiprocess import cpu_pinned_env


def _smoke(env):
    env = dict(env, PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "moe.smoke", "--steps", "8"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "smoke: loss" in proc.stdout, proc.stdout


def test_smoke_job_on_cpu():
    _smoke(cpu_pinned_env())


@pytest.mark.gpu
def test_smoke_job_on_cuda():
    """Failed before the tokens followed the model's device (an embedding lookup of CPU ids on CUDA weights)."""
    _smoke(dict(os.environ, MEGAGSPO_DEVICE="cuda"))
