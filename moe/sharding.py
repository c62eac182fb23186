"""Map between the full (TP=EP=1) Megatron state dict and one rank's shard of it, for any TP/EP layout.

The full state dict names experts by their global index (`...local_experts.{e}...` with e in 0..E-1);
a rank's module names them by local index. Tensor-parallel parameters carry Megatron's
`tensor_model_parallel` / `partition_dim` attributes; the SwiGLU `linear_fc1` is [gate; up] stacked, and
TP splits gate and up separately, so its shard is [gate_r; up_r], not a contiguous slice.
Pipeline stages own a contiguous range of layers; a stage's module numbers its layers from 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
