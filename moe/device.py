"""Which device the Megatron model runs on: this process's GPU when CUDA is usable, else the CPU.

`MEGAGSPO_DEVICE=cpu` pins a process to the CPU on a host that has GPUs (the CPU shim then applies in that
process, gloo replaces NCCL): the multi-process tests set it in their workers, because NCCL cannot run two
ranks on one GPU, and a user can set it to reproduce a CPU run on a GPU host. `MEGAGSPO_DEVICE=cuda` demands
CUDA and fails clearly where there is none; unset (or `auto`) picks CUDA when available.
"""

from __future__ import annotations

import os

import torch

from moe import cuda_calls
ENV = "MEGAGSPO_DEVICE"
CHOICES = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """MEGAGSPO_DEVICE asks for something this host cannot give."""


def use_cuda() -> bool:
    """True when the model runs on CUDA in this process (see the module docstring)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise DeviceError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(CHOICES)}")
    if choice == "cpu":
        return False
    available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        raise DeviceError(f"{ENV}=cuda but torch sees no CUDA device (torch {torch.__version__}, "
                          f"built with CUDA {torch.version.cuda})")
    return available


def model_device() -> torch.device:
    """The device this process's model lives on: its current GPU, or the CPU."""
    if use_cuda():
        return torch.device("cuda", cuda_calls.current_cuda_device())
    return torch.device("cpu")
