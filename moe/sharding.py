"""Map between the full (TP=EP=PP=1) Megatron state dict and one rank's shard of it, for any TP/EP/PP layout.

The full state dict names experts by their global index (`...local_experts.{e}...` with e in 0..E-1);
a rank's module names them by local index. Tensor-parallel parameters carry Megatron's
`tensor_model_parallel` / `partition_dim` attributes; the SwiGLU `linear_fc1` is [gate; up] stacked, and
TP splits gate and up separately, so its shard is [gate_r; up_r], not a contiguous slice.

Pipeline stages own a contiguous range of layers, and a stage's module numbers its layers from 0: local
`decoder.layers.{i}` is full `decoder.layers.{i + offset}`, with the offset from Megatron's own
`get_transformer_layer_offset` (`layer_offset`), so even splits, uneven ones
(`num_layers_in_first/last_pipeline_stage`) and `pipeline_model_parallel_layout` map as Megatron built them.
The embedding lives on the first stage, `decoder.final_layernorm` and `output_layer` on the last. With tied
word embeddings (`share_embeddings_and_output_weights`) and PP > 1 the last stage holds a copy of the
embedding as `output_layer.weight` (Megatron's `shared` parameter): its full name is
`embedding.word_embeddings.weight` (loaded from it; left out of the gather, which takes the first stage's).

`local_view_of_full` / `load_full_state_dict` go full -> shard (no communication); `gather_full_state_dict`
goes shard -> full (all-gathers over TP, expert-TP and EP, then an exchange over the pipeline group, so that
every rank returns the whole model). Both directions name parameters through `full_names`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.local_experts\.)(?P<index>\d+)(?P<suffix>\..*)$")
_LAYER = re.compile(r"^(?P<prefix>decoder\.layers\.)(?P<index>\d+)(?P<suffix>\..*)$")


@dataclass(frozen=True)
class RankCoordinates:
    """This rank's position in each tensor / expert parallel group and the group sizes (the pipeline stage
    and its layer offset come from Megatron's parallel_state, see `layer_offset`)."""

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
                       layer_offset: int = 0) -> str:
    """The full-model name of a rank-local parameter name: layers shifted by this pipeline stage's
    `layer_offset` (see `layer_offset`), experts renumbered by this EP rank's first global expert."""
    name = local_name
    match = _LAYER.match(name)
    if match and layer_offset:
        name = f"{match['prefix']}{int(match['index']) + layer_offset}{match['suffix']}"
    match = _EXPERT.match(name)
    if match:
        global_index = coords.ep_rank * num_local_experts + int(match["index"])
        name = f"{match['prefix']}{global_index}{match['suffix']}"
    return name


TIED_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"


def layer_offset(model) -> int:
    """The global index of this pipeline stage's first decoder layer (0 without pipeline parallelism).

    Megatron's own `get_transformer_layer_offset` (the function its TransformerBlock numbers layers and its
    sharded_state_dict names checkpoint keys with), checked against the layers' `layer_number`s (1-based,
    global) so that a mismatch fails here rather than misnaming tensors."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return 0
    offset = int(get_transformer_layer_offset(model.config, getattr(model, "vp_stage", None)))
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    numbers = [int(layer.layer_number) - 1 for layer in layers]
    if numbers != list(range(offset, offset + len(numbers))):
        raise RuntimeError(f"layer_offset: Megatron's offset {offset} for pipeline stage "
                           f"{ps.get_pipeline_model_parallel_rank()} does not match its layers' global numbers "
                           f"{numbers}")
    return offset


def is_tied_embedding_copy(model, local_name: str) -> bool:
    """True for the last stage's copy of the tied word embedding (`output_layer.weight` of a stage without
    the embedding, with share_embeddings_and_output_weights): a duplicate of `embedding.word_embeddings.weight`."""
    return (local_name == OUTPUT_WEIGHT and bool(getattr(model, "share_embeddings_and_output_weights", False))
            and not getattr(model, "pre_process", True))


def full_names(model, coords: RankCoordinates | None = None) -> dict[str, str]:
    """local parameter name -> its full-model (TP=EP=PP=1) name on this rank: layers by global number,
    experts by global index, the tied embedding's last-stage copy by the embedding's name."""
    coords = coords or RankCoordinates.current()
    num_local_experts = _num_local_experts(model)
    offset = layer_offset(model)
    return {name: (TIED_EMBEDDING if is_tied_embedding_copy(model, name)
                   else local_to_full_name(name, coords, num_local_experts, offset))
            for name, _ in model.named_parameters()}


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
    coords = coords or RankCoordinates.current()
    names = full_names(model, coords)
    out: dict[str, torch.Tensor] = {}
    for local_name, param in model.named_parameters():
        full_name = names[local_name]
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
    """The inverse of `local_view_of_full`: the full (TP=EP=PP=1) tensors under full names, on every rank.

    `tensors` maps local parameter names to tensors of the parameter's shape (default: the parameters
    themselves; Adam moments or gradients work the same way). Tensor-parallel shards are all-gathered over
    the TP group (expert-TP group for experts) and concatenated on `partition_dim` (the SwiGLU fc1 as
    [gate_0..gate_{n-1}; up_0..up_{n-1}], undoing `shard_tensor`), then experts over the EP group. With
    pipeline parallelism each stage names its layers globally (`full_names`) and the stages then exchange
    their tensors over the pipeline group (`_exchange_over_pipeline`), so every rank returns the same keys
    as a TP=EP=PP=1 model; the last stage's copy of a tied embedding is left out (the first stage's is the
    one). Collective: every rank of those groups calls it with the same parameters in the same order.
    """
    from megatron.core import parallel_state as ps

    coords = coords or RankCoordinates.current()
    gated = bool(getattr(model.config, "gated_linear_unit", True))
    num_local_experts = _num_local_experts(model)
    offset = layer_offset(model)
    names = full_names(model, coords)
    out: dict[str, torch.Tensor] = {}
    for local_name, param in model.named_parameters():
        if is_tied_embedding_copy(model, local_name):
            continue  # a duplicate of the first stage's embedding; every rank of this stage skips it alike
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
                out[local_to_full_name(local_name, replace(coords, ep_rank=r), num_local_experts, offset)] = part
        else:
            out[names[local_name]] = t.clone()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        first = next(model.parameters(), None)
        device = first.device if first is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        out = _exchange_over_pipeline(out, device)
    return out


def _exchange_over_pipeline(local: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Every stage's full-named tensors on every rank of the pipeline group, in stage order.

    Names, shapes and dtype names (plain strings and ints) go through all_gather_object; the tensors through
    broadcasts from each stage, one flat buffer per (stage, dtype)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    stage = ps.get_pipeline_model_parallel_rank()
    ranks = torch.distributed.get_process_group_ranks(group)  # global rank of each stage, in stage order
    meta = [(name, [int(d) for d in t.shape], str(t.dtype).removeprefix("torch.")) for name, t in local.items()]
    metas: list = [None] * len(ranks)
    torch.distributed.all_gather_object(metas, meta, group=group)
    seen: dict[str, int] = {}
    for s, entries in enumerate(metas):
        for name, _, _ in entries:
            if name in seen:
                raise RuntimeError(f"gather_full_state_dict: {name} is held by pipeline stages {seen[name]} and {s}")
            seen[name] = s
    out: dict[str, torch.Tensor] = {}
    for s, entries in enumerate(metas):
        received: dict[str, torch.Tensor] = {}
        for dtype_name in sorted({d for _, _, d in entries}):
            members = [(name, shape) for name, shape, d in entries if d == dtype_name]
            if s == stage:
                flat = torch.cat([local[name].reshape(-1) for name, _ in members]).to(device)
            else:
                numel = sum(torch.Size(shape).numel() for _, shape in members)
                flat = torch.empty(numel, dtype=getattr(torch, dtype_name), device=device)
            torch.distributed.broadcast(flat, src=ranks[s], group=group)
            if s == stage:
                continue
            start = 0
            for name, shape in members:
                n = torch.Size(shape).numel()
                received[name] = flat[start:start + n].view(shape).clone()  # own storage, as the local ones
                start += n
        out.update((name, local[name] if s == stage else received[name]) for name, _, _ in entries)
    return out


def _all_gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t, group=group)
    return parts
