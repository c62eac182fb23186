"""Parallel layout (TP / EP / PP / DP) and Megatron-Core process-group set-up."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A parallel layout does not divide the world or the model; the message names the sizes."""


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    expert_tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "expert_tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be an integer >= 1, got {value!r}")

    def data_parallel(self, world_size: int) -> int:
        """Data-parallel size of the dense (non-expert) parameters for `world_size` ranks."""
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        expert_model_parallel = self.expert_parallel * self.expert_tensor_parallel * self.pipeline_parallel
        for label, size in (("TP*PP", model_parallel), ("EP*ETP*PP", expert_model_parallel)):
            if world_size % size:
                raise LayoutError(f"world size {world_size} is not divisible by {label} = {size} for {self}")
        return world_size // model_parallel

    def check_model(self, num_layers: int, num_experts: int, num_heads: int, num_kv_heads: int,
                    vocab_size: int) -> None:
        checks = (
            ("num_experts", num_experts, "expert_parallel", self.expert_parallel),
            ("num_attention_heads", num_heads, "tensor_parallel", self.tensor_parallel),
            ("num_key_value_heads", num_kv_heads, "tensor_parallel", self.tensor_parallel),
            ("vocab_size", vocab_size, "tensor_parallel", self.tensor_parallel),
            ("num_hidden_layers", num_layers, "pipeline_parallel", self.pipeline_parallel),
        )
        for field_name, value, layout_name, size in checks:
            if value % size:
                raise LayoutError(f"{field_name}={value} is not divisible by {layout_name}={size}")


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a 1-rank group without it."""
    if torch.distributed.is_initialized():
        return
    from moe.device import use_cuda

    cuda = use_cuda()
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:  # one GPU per process (torchrun's LOCAL_RANK), before NCCL binds a device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:
        # An in-memory store: no port is taken and no MASTER_ADDR / MASTER_PORT is left in os.environ, where
        # a child process (a torchrun or CLI run started from this one) would inherit it and collide.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    else:
        torch.distributed.init_process_group(backend)


def initialize_model_parallel(layout: ParallelLayout) -> None:
    """Create Megatron-Core's TP/EP/PP/DP groups for `layout` over the initialised world."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        raise RuntimeError("initialize_model_parallel: call init_distributed() first")
    layout.data_parallel(torch.distributed.get_world_size())  # raises a named LayoutError
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel,
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (the OS picks it), for a rendezvous another process will bind: a
    torch.distributed store (MASTER_PORT) or an NCCL weight-update group. Another process may take it
    before the caller binds it; callers that bind at once make that race unlikely."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
