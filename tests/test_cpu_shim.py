"""The Megatron-Core CPU shim: explicit, CUDA-gated, logged, and loud when Megatron changes under it.

On a GPU host the shim is never applied in this (pytest) process: it patches torch.cuda process-wide and would
break the CUDA tests that run after it. Its global patches are checked in a CPU-pinned subprocess (no visible
GPU, MEGAGSPO_DEVICE=cpu); its scoped patches, restored on exit, run here with MEGAGSPO_DEVICE=cpu.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from multiprocess import cpu_pinned_env


def _run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter pinned to the CPU (a CUDA-less process also on a GPU host)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                          env=cpu_pinned_env())


def test_every_patched_symbol_exists_with_the_recorded_signature():
    from moe.cpu_shim import PATCH_TARGETS, verify_patch_targets

    assert len(PATCH_TARGETS) >= 6
    assert {("torch.cuda", "synchronize"), ("megatron.core.dist_checkpointing.strategies.filesystem_async",
                                            "FileSystemWriterAsync.preload_tensors")} <= {
        (t.module, t.attribute) for t in PATCH_TARGETS}
    verify_patch_targets()


def test_a_changed_signature_fails_loudly(monkeypatch):
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    from moe.cpu_shim import MegatronShimError, verify_patch_targets

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False):  # an "upgraded" Megatron lost an argument
        return tensor

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    with pytest.raises(MegatronShimError, match="maybe_move_tensor_to_cpu changed signature"):
        verify_patch_targets()


def test_a_missing_symbol_fails_loudly(monkeypatch):
    import megatron.core.transformer.moe.moe_utils as moe_utils

    from moe.cpu_shim import MegatronShimError, verify_patch_targets

    monkeypatch.delattr(moe_utils, "RouterGatingLinearFunction")
    with pytest.raises(MegatronShimError, match="RouterGatingLinearFunction.forward no longer exists"):
        verify_patch_targets()


def test_import_changes_nothing_and_apply_logs_each_change_once():
    result = _run_python(
        """
        import logging, torch
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        import moe.cpu_shim as shim
        try:
            torch.cuda.current_device()
            raise SystemExit("torch.cuda.current_device() worked before the shim was applied")
        except (AssertionError, RuntimeError):
            pass
        assert not shim.is_applied()
        changes = shim.apply_cpu_shim()
        # (1)-(9) of moe/cpu_shim.py, (2) being moe.megatron_compat's two lines (te_general_gemm, Adam's step)
        assert len(changes) == 10 and len(set(changes)) == 10, changes
        assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.synchronize() is None  # (6) the dist_checkpointing save path calls it
        assert shim.apply_cpu_shim() == changes  # idempotent
        import megatron.core.transformer.moe.moe_utils as moe_utils
        assert moe_utils.te_general_gemm is None
        import json
        print(json.dumps(changes))
        print("OK")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")
    import json

    changes = json.loads(result.stdout.strip().splitlines()[-2])
    # Each change logged exactly once: the shim's own, and the compat step's by moe.megatron_compat.
    prefixes = ("megagspo CPU shim: ", "megagspo Megatron compat: ")
    logged = [line.split(": ", 1)[1] for line in result.stderr.splitlines() if line.startswith(prefixes)]
    assert len(logged) == 10 and sorted(logged) == sorted(changes), result.stderr[-3000:]


def test_cuda_host_is_left_alone(monkeypatch):
    import torch

    import moe.cpu_shim as shim

    monkeypatch.delenv("MEGAGSPO_DEVICE", raising=False)  # not pinned: CUDA "available" means CUDA is used
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shim, "_APPLIED", [])
    assert shim.apply_cpu_shim() == []
    assert not shim.is_applied()


def test_pipeline_schedule_shim_is_scoped_to_the_schedules_module(monkeypatch):
    """Inside the block the schedules' `torch.zeros(device="cuda")` lands on the CPU (a CPU process:
    MEGAGSPO_DEVICE=cpu, so also on a GPU host); torch itself, and the schedules after the block, are
    untouched; a Megatron that no longer makes the call is reported instead of patched."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    from moe import cpu_shim

    monkeypatch.setenv("MEGAGSPO_DEVICE", "cpu")  # the block's patch is scoped and restored: safe in this process
    original, original_zeros = schedules.torch, torch.zeros
    with cpu_shim.pipeline_schedule_on_cpu():
        counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        assert counter.device.type == "cpu" and counter.dtype == torch.int
        assert schedules.torch.distributed is torch.distributed and schedules.torch.Tensor is torch.Tensor
        assert torch.zeros is original_zeros  # torch itself is not patched:
        if torch.cuda.is_available():
            assert torch.zeros([], device="cuda").device.type == "cuda"
        else:
            with pytest.raises((AssertionError, RuntimeError)):
                torch.zeros([], device="cuda")
    assert schedules.torch is original


def test_pipeline_schedule_shim_refuses_a_changed_megatron(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    from moe import cpu_shim

    monkeypatch.setenv("MEGAGSPO_DEVICE", "cpu")  # a CPU process, also on a GPU host (the shim is scoped)
    monkeypatch.setattr(cpu_shim.inspect, "getsource", lambda obj: "def forward_backward(): pass")
    with pytest.raises(cpu_shim.MegatronShimError, match="token counter"):
        with cpu_shim.pipeline_schedule_on_cpu():
            pass
    assert schedules.torch.__name__ == "torch"
