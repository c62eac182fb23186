"""The process layout, described once: sizes (`ParallelLayout`, and `ParallelShape` for a world size), and the
process groups of a started run (`ParallelDims`, built once where Megatron-Core's groups are made, by
`setup_process_groups`), with the few collectives a training step needs.

    ParallelLayout   TP / EP / PP (/ expert-TP) sizes, as a recipe asks for them
    ParallelShape    a layout over a world size: DP and expert-DP sizes; what the dry run and the planner check
    ParallelDims     a ParallelShape plus this rank's groups and ranks (TP, PP, EP, expert-TP, DP, model-parallel
                     = TP x PP)
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Type, TypeVar

import torch

from moe import cuda_calls
from moe.collective import max_over, run_on_rank0, sum_over
from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
from moe.device import use_cuda

T = TypeVar("T")


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


@dataclass(frozen=True)
class ParallelShape:
    """A layout over `world_size` processes: every size, no process group (the dry run and the planner use it
    where no process exists; a run's ParallelDims holds the same object). Raises LayoutError where the
    layout does not divide the world."""

    layout: ParallelLayout
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise LayoutError(f"world size must be an integer >= 1, got {self.world_size!r}")
        self.layout.data_parallel(self.world_size)

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_parallel

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_parallel

    @property
    def ep_size(self) -> int:
        return self.layout.expert_parallel

    @property
    def mp_size(self) -> int:
        """TP x PP: the ranks that hold one copy of the dense model together."""
        return self.tp_size * self.pp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.mp_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // (self.ep_size * self.layout.expert_tensor_parallel * self.pp_size)

    @property
    def seq_multiple(self) -> int:
        """Sequence parallelism splits S over the TP ranks: model inputs are a multiple of this long."""
        return self.tp_size

    def seq_length(self, natural: int) -> int:
        """Model input length >= natural, a multiple of seq_multiple."""
        return -(-natural // self.seq_multiple) * self.seq_multiple

    def as_dict(self) -> dict:
        """The sizes by name (a checkpoint records the layout that wrote it)."""
        return {"tensor_parallel": self.tp_size, "expert_parallel": self.ep_size,
                "pipeline_parallel": self.pp_size, "data_parallel": self.dp_size}


@dataclass(frozen=True)
class DPShare:
    """This data-parallel rank's share of a list drawn identically on every rank: rank `rank` of `size` keeps the
    contiguous slice [rank * n, (rank + 1) * n), n = len // size. Plain values, no process group: a process without
    one (the rollout producer) draws the same share as the trainer rank it serves."""

    rank: int
    size: int

    def of(self, items: list) -> list:
        n = len(items) // self.size
        return items[self.rank * n:(self.rank + 1) * n]


@dataclass(frozen=True)
class ParallelDims:
    """The process layout of a started run, built once by `setup_process_groups` (or `from_process_groups`
    after `initialize_model_parallel`) and passed to whatever needs sizes, ranks or groups. Groups are
    torch.distributed process groups; `pp_last_rank` is the global rank of the last pipeline stage of this
    rank's pipeline."""

    shape: ParallelShape
    rank: int
    tp_group: Any
    tp_rank: int
    pp_group: Any
    pp_rank: int
    pp_last_rank: int
    ep_group: Any
    ep_rank: int
    dp_group: Any
    dp_rank: int
    mp_group: Any
    mp_rank: int
    etp_group: Any = None  # expert tensor parallelism (moe.sharding gathers expert shards over it)
    etp_rank: int = 0

    @classmethod
    def from_process_groups(cls, layout: ParallelLayout) -> "ParallelDims":
        """Read Megatron-Core's groups (made by initialize_model_parallel(layout)) once."""
        from megatron.core import parallel_state as ps

        dist = torch.distributed
        mp_group = ps.get_model_parallel_group()
        dims = cls(shape=ParallelShape(layout, dist.get_world_size()), rank=dist.get_rank(),
                   tp_group=ps.get_tensor_model_parallel_group(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_group=ps.get_pipeline_model_parallel_group(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
                   ep_group=ps.get_expert_model_parallel_group(), ep_rank=ps.get_expert_model_parallel_rank(),
                   dp_group=ps.get_data_parallel_group(), dp_rank=ps.get_data_parallel_rank(),
                   mp_group=mp_group, mp_rank=dist.get_rank(mp_group),
                   etp_group=ps.get_expert_tensor_parallel_group(), etp_rank=ps.get_expert_tensor_parallel_rank())
        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                 ps.get_expert_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                 dist.get_world_size(mp_group))
        want = (dims.tp_size, dims.pp_size, dims.ep_size, dims.dp_size, dims.mp_size)
        if sizes != want:
            raise LayoutError(f"Megatron's process groups (TP, PP, EP, DP, TP x PP) = {sizes} are not those of "
                              f"{layout} over {dims.world_size} processes {want}")
        return dims

    # ---- sizes (of the shape) -------------------------------------------------------------------------------
    @property
    def layout(self) -> ParallelLayout:
        return self.shape.layout

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def tp_size(self) -> int:
        return self.shape.tp_size

    @property
    def pp_size(self) -> int:
        return self.shape.pp_size

    @property
    def ep_size(self) -> int:
        return self.shape.ep_size

    @property
    def dp_size(self) -> int:
        return self.shape.dp_size

    @property
    def mp_size(self) -> int:
        return self.shape.mp_size

    @property
    def etp_size(self) -> int:
        return self.layout.expert_tensor_parallel

    @property
    def seq_multiple(self) -> int:
        return self.shape.seq_multiple

    def seq_length(self, natural: int) -> int:
        return self.shape.seq_length(natural)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the rank that writes the run's files and prints."""
        return self.rank == 0

    @property
    def generates(self) -> bool:
        """Model-parallel rank 0 of its data-parallel rank: the rank that generates rollouts, scores and
        evaluates for its TP x PP peers (they receive its results)."""
        return self.mp_rank == 0

    # ---- the collectives a step needs -----------------------------------------------------------------------
    def dp_sum(self, values: List[float]) -> List[float]:
        """Python numbers summed elementwise over the data-parallel group (float64)."""
        return sum_over(values, self.dp_group)

    def world_max(self, values: List[float]) -> List[float]:
        """Python numbers, each the largest over every process of the run."""
        return max_over(values, None)

    def dp_gather(self, values: List[float]) -> List[List[float]]:
        """Every data-parallel rank's `values` (a list of one length on every rank), rank by rank."""
        slot = [0.0] * (len(values) * self.dp_size)
        slot[self.dp_rank * len(values):(self.dp_rank + 1) * len(values)] = values
        total = self.dp_sum(slot)
        return [total[r * len(values):(r + 1) * len(values)] for r in range(self.dp_size)]

    def dp_all_to_all(self, x: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> torch.Tensor:
        """x's rows [n, ...] sent in rank order over the data-parallel group (send_counts[r] rows to rank r) -> the
        rows received, in rank order. Any dtype and device: bool travels as uint8 and integers narrower than 32 bits
        as int32 (what every backend takes), each on `x`'s device; the result has x's dtype."""
        wire = x.to(torch.uint8) if x.dtype == torch.bool else x
        if wire.dtype in (torch.int8, torch.int16):
            wire = wire.to(torch.int32)
        wire = wire.contiguous()
        out = wire.new_empty((sum(recv_counts), *wire.shape[1:]))
        torch.distributed.all_to_all_single(out, wire, output_split_sizes=list(recv_counts),
                                            input_split_sizes=list(send_counts), group=self.dp_group)
        return out.to(x.dtype)

    def pp_any(self, mask: torch.Tensor) -> torch.Tensor:
        """A per-token bool mask OR-ed over the pipeline stages (each holds its own layers)."""
        if self.pp_size == 1:
            return mask
        wire = mask.to(torch.int32)
        torch.distributed.all_reduce(wire, op=torch.distributed.ReduceOp.MAX, group=self.pp_group)
        return wire.bool()

    def pp_sum(self, values: List[float]) -> List[float]:
        """Per-stage counts (each stage holds its own layers) summed over the pipeline."""
        return sum_over(values, self.pp_group)

    def on_rank0(self, what: str, fn: Callable[[], T], peer_error: Optional[Type[Exception]] = None) -> T:
        """fn() on global rank 0 only; its result, or its error, reaches every rank (moe.collective.run_on_rank0)."""
        return run_on_rank0(what, fn, None, peer_error=peer_error)

    def on_mp_rank0(self, what: str, fn: Callable[[], T]) -> T:
        """fn() on model-parallel rank 0 only, its result broadcast to its TP x PP peers; fn() itself without
        model parallelism."""
        if self.mp_size == 1:
            return fn()
        return run_on_rank0(what, fn, self.mp_group)

    @property
    def dp_share(self) -> DPShare:
        return DPShare(self.dp_rank, self.dp_size)

    def local_slice(self, items: list) -> list:
        """This data-parallel rank's contiguous share of a list drawn identically on every rank (DPShare)."""
        return self.dp_share.of(items)

    def from_last_stage(self, obj):
        """A picklable object made on the last pipeline stage (metrics), on every stage of the pipeline."""
        if self.pp_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
        return box[0]


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a 1-rank group without it."""
    if torch.distributed.is_initialized():
        return
    cuda = use_cuda()
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:  # one GPU per process (torchrun's LOCAL_RANK), before NCCL binds a device
        cuda_calls.set_cuda_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:
        # An in-memory store: no port is taken and no MASTER_ADDR / MASTER_PORT is left in os.environ, where
        # a child process (a torchrun or CLI run started from this one) would inherit it and collide.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    else:
        torch.distributed.init_process_group(backend)


def initialize_model_parallel(layout: ParallelLayout) -> ParallelDims:
    """Create Megatron-Core's TP/EP/PP/DP groups for `layout` over the initialised world. -> their ParallelDims."""
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
    return ParallelDims.from_process_groups(layout)


def setup_process_groups(layout: ParallelLayout, seed: int) -> ParallelDims:
    """torch.distributed (NCCL on GPU, gloo with the CPU shim on CPU; one rank without torchrun), Megatron's
    groups for `layout`, and its RNG: the one place a run's process layout is made. -> ParallelDims."""
    problem = cuda_calls.torch_version_problem()
    if problem:
        logging.getLogger(__name__).warning("megagspo: %s", problem)
    cuda = use_cuda()
    if not cuda:
        apply_cpu_shim()
    init_distributed()
    dims = initialize_model_parallel(layout)
    if cuda:
        # Megatron's CUDA RNG tracker (per-TP-rank streams for sharded weights and dropout) and the torch seed
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        initialize_cpu_rng(seed)
    return dims


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
