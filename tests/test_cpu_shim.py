"""The Megatron-Core CPU shim: explicit, CUDA-gated, logged, and loud when Megatron changes under it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180)


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
        assert len(changes) == 6, changes
        assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.synchronize() is None  # (6) the dist_checkpointing save path calls it
        assert shim.apply_cpu_shim() == changes  # idempotent
        import megatron.core.transformer.moe.moe_utils as moe_utils
        assert moe_utils.te_general_gemm is None
        print("OK")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")
    logged = [line for line in result.stderr.splitlines() if line.startswith("megagspo CPU shim:")]
    assert len(logged) == 6, result.stderr[-3000:]


def test_cuda_host_is_left_alone(monkeypatch):
    import torch

    import moe.cpu_shim as shim

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shim, "_APPLIED", [])
    assert shim.apply_cpu_shim() == []
    assert not shim.is_applied()


def test_pipeline_schedule_shim_is_scoped_to_the_schedules_module():
    """Inside the block the schedules' `torch.zeros(device="cuda")` lands on the CPU (this host has no CUDA);
    torch itself, and the schedules after the block, are untouched; a Megatron that no longer makes the call
    is reported instead of patched."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    from moe import cpu_shim

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the shim does nothing there (checked by test_cuda_host_is_left_alone)")
    original = schedules.torch
    with cpu_shim.pipeline_schedule_on_cpu():
        counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        assert counter.device.type == "cpu" and counter.dtype == torch.int
        assert schedules.torch.distributed is torch.distributed and schedules.torch.Tensor is torch.Tensor
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros([], device="cuda")  # torch itself is not patched
    assert schedules.torch is original


def test_pipeline_schedule_shim_refuses_a_changed_megatron(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    import torch

    from moe import cpu_shim

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the shim does nothing there (checked by test_cuda_host_is_left_alone)")
    monkeypatch.setattr(cpu_shim.inspect, "getsource", lambda obj: "def forward_backward(): pass")
    with pytest.raises(cpu_shim.MegatronShimError, match="token counter"):
        with cpu_shim.pipeline_schedule_on_cpu():
            pass
    assert schedules.torch.__name__ == "torch"
