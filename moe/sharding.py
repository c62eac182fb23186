"""Map between the full (TP=EP=1) Megatron state dict and one rank's shard of it, for any TP/EP layout.

The full state dict names experts by their global index (`...local_experts.{e}...` with e in 0..E-1);
a rank's module names them by local index. Tensor-parallel parameters carry Megatron's
`tensor_model_parallel` / `partition_dim` attributes; the SwiGLU `linear_fc1` is [gate; up] stacked, and
TP splits gate and up separately, so its shard is [gate_r; up_r], not a contiguous slice.
Pipeline stages own a contiguous range of layers; a stage's module numbers its layers from 0.
`local_view_of_full` / `load_full_state_dict` go full -> shard (no communication); `gather_full_state_dict`
goes shard -> full (all-gathers over TP, expert-TP and EP).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.local_experts\.)(?P<index>\d+)(?P<suffix>\..*)$")
_LAYER = re.compile(r"^(?P<prefix>decoder\.layers\.)(?P<index>\d+)(?P<suffix>\..*)$")


@dataclass(frozen=True)
class RankCoordinates:
    """This rank's position in each parallel group and the group sizes."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def current(cls) -> "RankCoordinates":
        from megatron.core import parallel_state as ps

        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
        )


def is_expert_param(local_name: str) -> bool:
    return _EXPERT.match(local_name) is not None


def local_to_full_name(local_name: str, coords: RankCoordinates, num_local_experts: int,
                       layers_per_stage: int = 0, pp_rank: int = 0) -> str:
    """The full-model name of a rank-local parameter name."""
    name = local_name
    match = _LAYER.match(name)
    if match and layers_per_stage:
        name = f"{match['prefix']}{int(match['index']) + pp_rank * layers_per_stage}{match['suffix']}"
    match = _EXPERT.match(name)
    if match:
        global_index = coords.ep_rank * num_local_experts + int(match["index"])
        name = f"{match['prefix']}{global_index}{match['suffix']}"
    return name


def shard_tensor(full: torch.Tensor, local_name: str, param: torch.Tensor, coords: RankCoordinates,
                 gated_linear_unit: bool = True) -> torch.Tensor:
    """This rank's slice of `full`, the tensor the local parameter `param` holds."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    expert = is_expert_param(local_name)
    rank, size = (coords.etp_rank, coords.etp_size) if expert else (coords.tp_rank, coords.tp_size)
    if size == 1:
        return full
    dim = param.partition_dim
    if gated_linear_unit and local_name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(gate, size, dim=dim)[rank], torch.chunk(up, size, dim=dim)[rank]], dim=dim)
    return torch.chunk(full, size, dim=dim)[rank]


def local_view_of_full(model, full: dict[str, torch.Tensor], coords: RankCoordinates | None = None,
                       gated_linear_unit: bool = True) -> dict[str, torch.Tensor]:
    """For each local parameter name, its slice of the full-model tensors in `full` (weights or grads).

    Raises KeyError naming the full name when `full` lacks a tensor, and ValueError naming the tensor and
    both shapes when a slice does not fit the local parameter.
    """
    from megatron.core import parallel_state as ps

    coords = coords or RankCoordinates.current()
    num_local_experts = _num_local_experts(model)
    pp_size = ps.get_pipeline_model_parallel_world_size()
    layers_per_stage = model.config.num_layers // pp_size if pp_size > 1 else 0
    pp_rank = ps.get_pipeline_model_parallel_rank()
    out: dict[str, torch.Tensor] = {}
    for local_name, param in model.named_parameters():
        full_name = local_to_full_name(local_name, coords, num_local_experts, layers_per_stage, pp_rank)
        if full_name not in full:
            raise KeyError(f"full state dict has no tensor {full_name!r} (for local parameter {local_name!r})")
        piece = shard_tensor(full[full_name], local_name, param, coords, gated_linear_unit)
        if tuple(piece.shape) != tuple(param.shape):
            raise ValueError(
                f"{full_name}: slice shape {tuple(piece.shape)} does not match local parameter "
                f"{local_name} shape {tuple(param.shape)} (full tensor {tuple(full[full_name].shape)})"
            )
        out[local_name] = piece
    return out


@torch.no_grad()
def load_full_state_dict(model, full: dict[str, torch.Tensor], coords: RankCoordinates | None = None) -> None:
    """Copy this rank's slices of the full-model tensors into `model`'s parameters."""
    gated = bool(getattr(model.config, "gated_linear_unit", True))
    pieces = local_view_of_full(model, full, coords, gated)
    for local_name, param in model.named_parameters():
        param.copy_(pieces[local_name])


def _num_local_experts(model) -> int:
    num_experts = model.config.num_moe_experts or 0
    if not num_experts:
        return 0
    from megatron.core import parallel_state as ps

    return num_experts // ps.get_expert_model_parallel_world_size()


@torch.no_grad()
def gather_full_state_dict(model, tensors: dict[str, torch.Tensor] | None = None,
                           coords: RankCoordinates | None = None) -> dict[str, torch.Tensor]:
    """The inverse of `local_view_of_full`: the full (TP=EP=1) tensors under full names, on every rank.

    `tensors` maps local parameter names to tensors of the parameter's shape (default: the parameters
    themselves; Adam moments or gradients work the same way). Tensor-parallel shards are all-gathered over
    the TP group (expert-TP group for experts) and concatenated on `partition_dim` (the SwiGLU fc1 as
    [gate_0..gate_{n-1}; up_0..up_{n-1}], undoing `shard_tensor`), then experts over the EP group.
    Collective: every rank of those groups calls it with the same parameters in the same order. One pipeline
    stage holds only its own layers, so this refuses pipeline parallelism (gather the stages separately).
    """
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("gather_full_state_dict: pipeline_parallel > 1 is not supported (each stage holds "
                         "only its layers); use pipeline_parallel = 1")
    coords = coords or RankCoordinates.current()
    gated = bool(getattr(model.config, "gated_linear_unit", True))
    num_local_experts = _num_local_experts(model)
    out: dict[str, torch.Tensor] = {}
    for local_name, param in model.named_parameters():
        t = (param if tensors is None else tensors[local_name]).detach()
        expert = is_expert_param(local_name)
        size = coords.etp_size if expert else coords.tp_size
        if getattr(param, "tensor_model_parallel", False) and size > 1:
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            parts = _all_gather(t, size, group)
            dim = param.partition_dim
            if gated and local_name.endswith("linear_fc1.weight"):
                halves = [torch.chunk(p, 2, dim=dim) for p in parts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
            else:
                t = torch.cat(parts, dim=dim)
        if expert and coords.ep_size > 1:
            parts = _all_gather(t, coords.ep_size, ps.get_expert_model_parallel_group())
            for r, part in enumerate(parts):
                out[local_to_full_name(local_name, replace(coords, ep_rank=r), num_local_experts)] = part
        else:
            out[local_to_full_name(local_name, coords, num_local_experts)] = t.clone()
    return out


def _all_gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t, group=group)
    return parts
