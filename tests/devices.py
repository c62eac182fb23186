"""Test-only helpers (holds no tests itself) for running one test body on the CPU and, marked `gpu`, on CUDA.

    from devices import DEVICES, child_env, megatron_groups

    def _body(rank, world_size, seed):
        megatron_groups(seed)  # the CPU shim, Megatron's groups, its RNG in the form of the child's device
        ...

    @pytest.mark.parametrize("device", DEVICES)
    def test_x(device):
        (out,) = run_distributed(_body, world_size=1, args=(seed,), env=child_env(device))

DEVICES is ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]: tests/conftest.py skips the CUDA variant on a
host without CUDA, so CI runs exactly the CPU test it ran before; `pytest -m gpu` on a GPU host selects the CUDA
variants. MEGAGSPO_TEST_DEVICE=cpu or =cuda narrows the list to that one device (unset or `all`: both), so
`MEGAGSPO_TEST_DEVICE=cuda pytest tests/test_routing_r3.py` runs that file's device-parametrised bodies on
CUDA only.

A CUDA child of tests/multiprocess.run_distributed gets `child_env("cuda")` = MEGAGSPO_DEVICE=cuda and the
first visible GPU: its process group is `cpu:gloo,cuda:nccl` (multiprocess.process_group_backend), and one GPU
means world_size 1 (NCCL refuses two ranks on one GPU).

Tolerances: a comparison that is bit-exact on the CPU may become `torch.testing.assert_close` on CUDA, with the
tolerance and its reason stated beside it. The reasons that recur: the MoE unpermute adds expert outputs back
into token order with a scatter-add (`index_add_` / `scatter_add_`), whose CUDA kernel uses atomics (not
deterministic order in float32); cuBLAS picks GEMM algorithms (split-K) by shape, so two mathematically equal
forwards with different per-expert batch shapes sum in different orders. TF32 is NOT a reason: torch leaves
`torch.backends.cuda.matmul.allow_tf32` False by default (and cuDNN convolutions, which allow TF32, are not
used by these models); `assert_no_tf32()` checks that the default has not been changed.
"""

from __future__ import annotations

import os

import pytest
import torch

ENV = "MEGAGSPO_TEST_DEVICE"
_ALL = ("cpu", "cuda")


def requested_devices() -> tuple[str, ...]:
    """The devices MEGAGSPO_TEST_DEVICE asks for: ("cpu",), ("cuda",) or both (unset / `all`)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "all"):
        return _ALL
    if value not in _ALL:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected cpu, cuda or all")
    return (value,)


def device_params() -> list:
    """pytest parameters for a `device` argument: "cpu", and "cuda" marked `gpu` (skipped without CUDA)."""
    params = {"cpu": "cpu", "cuda": pytest.param("cuda", marks=pytest.mark.gpu)}
    return [params[d] for d in requested_devices()]


DEVICES = device_params()


def cuda_env() -> dict:
    """The env= of a run_distributed child (or a subprocess) that runs on this host's first visible GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    return {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": visible}


def child_env(device: str) -> dict | None:
    """run_distributed's env= for `device`: None (the harness's CPU pinning) or cuda_env()."""
    if device == "cpu":
        return None
    if device == "cuda":
        return cuda_env()
    raise ValueError(f"unknown test device {device!r}")


def seed_megatron(seed: int) -> None:
    """Inside a child: Megatron's RNG tracker in the form of the child's device (the CUDA tracker on a GPU,
    where weights initialise on the device, after checking TF32 is off; else moe.cpu_shim's CPU form), torch
    seeded either way."""
    from moe.cpu_shim import initialize_cpu_rng
    from moe.device import use_cuda

    if use_cuda():
        from megatron.core import tensor_parallel

        assert_no_tf32()
        torch.manual_seed(seed)
        # the ranks given: these children are one process (rank 0 of every group), and a body may seed before
        # it initialises model parallelism (or re-initialise it per model, as the weight-sync body does)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    else:
        initialize_cpu_rng(seed)


def megatron_groups(seed: int | None = None, **layout_kwargs):
    """Inside a child (its torch.distributed group is up): the CPU shim (nothing on a CUDA host), Megatron's
    TP / EP / PP / DP groups for ParallelLayout(**layout_kwargs), and, given a seed, Megatron's RNG
    (seed_megatron). -> the ParallelLayout. What the single-process and gloo model tests set up before they
    build a model; a run's own form of it is moe.parallel.setup_process_groups."""
    from moe.cpu_shim import apply_cpu_shim
    from moe.parallel import ParallelLayout, initialize_model_parallel

    apply_cpu_shim()
    layout = ParallelLayout(**layout_kwargs)
    initialize_model_parallel(layout)
    if seed is not None:
        seed_megatron(seed)
    return layout


def child_device() -> torch.device:
    """Inside a child: the device its model is built on (moe.device.model_device)."""
    from moe.device import model_device

    return model_device()


def assert_no_tf32() -> None:
    """The CUDA tolerances of these tests assume full float32 GEMMs (torch's default)."""
    if torch.cuda.is_available():
        assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmul is on: the float32 tolerances assume it off"
