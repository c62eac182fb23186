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

`local_view_of_full` / `load_full_state_dict` go full -> shard (no communication). Shard -> full has one
implementation, `FullStateBuckets` (`iter_full_state_buckets`): the full tensors in a fixed order, gathered one
at a time over TP / expert-TP, EP and the pipeline, delivered in buckets of at most `bucket_bytes` to the ranks
that ask for them (the rollout ranks), so that no rank ever holds the whole model; `gather_full_state_dict` is
the same with one unbounded bucket on every rank. Both directions name parameters through `full_names`.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, replace

import torch

from moe.device import model_device
from moe.parallel import ParallelDims

_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.local_experts\.)(?P<index>\d+)(?P<suffix>\..*)$")
_LAYER = re.compile(r"^(?P<prefix>decoder\.layers\.)(?P<index>\d+)(?P<suffix>\..*)$")


@dataclass(frozen=True)
class RankCoordinates:
    """This rank's position in each tensor / expert parallel group and the group sizes (the pipeline stage
    and its layer offset come from Megatron's parallel_state, see `layer_offset`). `of(dims)` takes them from
    a run's moe.parallel.ParallelDims; `current()` reads Megatron's parallel_state (callers without one)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def of(cls, dims: ParallelDims) -> "RankCoordinates":
        return cls(tp_rank=dims.tp_rank, tp_size=dims.tp_size, ep_rank=dims.ep_rank, ep_size=dims.ep_size,
                   etp_rank=dims.etp_rank, etp_size=dims.etp_size)

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
    num_local_experts = _num_local_experts(model, coords)
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


def _num_local_experts(model, coords: RankCoordinates) -> int:
    return (model.config.num_moe_experts or 0) // coords.ep_size


DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Default cap (bytes) of one weight-sync bucket (`iter_full_state_buckets`): 512 MiB, a few of the largest
Qwen3-30B-A3B tensors (its bf16 embedding alone is 594 MiB, and travels as a bucket of its own)."""


@torch.no_grad()
def gather_full_state_dict(model, tensors: dict[str, torch.Tensor] | None = None,
                           coords: RankCoordinates | None = None,
                           dims: ParallelDims | None = None) -> dict[str, torch.Tensor]:
    """The inverse of `local_view_of_full`: the full (TP=EP=PP=1) tensors under full names, on every rank.

    `tensors` maps local parameter names to tensors of the parameter's shape (default: the parameters
    themselves; Adam moments or gradients work the same way). It is `iter_full_state_buckets` with one bucket
    and every rank receiving (the one copy of the per-tensor gather: TP shards concatenated on `partition_dim`,
    the SwiGLU fc1 as [gate_0..gate_{n-1}; up_0..up_{n-1}] undoing `shard_tensor`, experts from their EP rank,
    then each stage's tensors to the other stages), so every rank returns the same keys as a TP=EP=PP=1
    model, in stage order; the last stage's copy of a tied embedding is left out (the first stage's is the
    one). Every returned tensor has its own storage (none aliases a parameter). This holds the WHOLE model on
    every rank: to feed a rollout engine use `iter_full_state_buckets`. Collective over the TP, expert-TP, EP
    and pipeline groups: every rank of them calls it. `dims`: as in `FullStateBuckets`.
    """
    out: dict[str, torch.Tensor] = {}
    for bucket in FullStateBuckets(model, None, receive=True, tensors=tensors, coords=coords, copy=True, dims=dims):
        out.update(bucket)
    return out


def iter_full_state_buckets(model, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, *, receive: bool = True,
                            tensors: dict[str, torch.Tensor] | None = None,
                            coords: RankCoordinates | None = None,
                            dims: ParallelDims | None = None) -> "FullStateBuckets":
    """The full (TP=EP=PP=1) model in buckets of at most `bucket_bytes`, gathered one bucket at a time;
    `receive`: whether THIS rank wants the buckets (ranks that do not get empty dicts). Collective: every rank of
    the TP / expert-TP / EP / pipeline groups calls it at once and iterates the result to the end. See
    `FullStateBuckets`."""
    return FullStateBuckets(model, bucket_bytes, receive=receive, tensors=tensors, coords=coords, dims=dims)


@dataclass(frozen=True)
class BucketEntry:
    """One full-model tensor of a sync plan: its full name, shape and dtype name, the pipeline stage that holds
    it, the local parameter it is gathered from on that stage, the EP rank that holds it (experts; None for
    the others, held by every EP rank of the stage), and how it is split over TP (or expert-TP for experts):
    `split` shards on `partition_dim`, `glu` for the SwiGLU fc1 ([gate_r; up_r] shards)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    stage: int
    local_name: str
    expert_owner: int | None
    split: int
    partition_dim: int | None
    glu: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


class FullStateBuckets:
    """The full (TP=EP=PP=1) Megatron state, streamed in buckets: iterate it to get, once per bucket, a dict
    {full name: full tensor} whose tensors total at most `bucket_bytes` (a single tensor bigger than the cap is
    a bucket of its own; `bucket_bytes=None`: one bucket holding everything). Concatenated, the buckets are
    exactly `gather_full_state_dict(model, tensors)`, in the same order.

    Plan. The order is fixed and the same on every rank: pipeline stages in order, and within a stage the
    local parameters in `named_parameters` order, an expert parameter standing for the same local expert of
    every EP rank (EP rank 0 first); the last stage's copy of a tied embedding is left out. Each stage builds
    its part from its own parameters (full shapes from the TP split); the parts and the receive flags travel
    once through `all_gather_object` over the pipeline group (names, shapes, dtype names: a few MB for a 30B
    model), the need flags below over the EP, TP and expert-TP groups, with a digest of the plan that every
    peer must share (a mismatch raises before any tensor moves, instead of misaligned collectives). Buckets are
    consecutive runs of that order cut under the cap (`len()` is known before iterating).

    Moving one tensor X held by stage s (one collective step at a time, each skipped when no rank downstream
    needs its result, so ranks that neither receive nor relay hold nothing):
      1. TP: the stage's TP group (expert-TP group of X's EP rank, for experts) assembles X from its shards:
         `gather` to the one member that needs it, `all_gather` when several do (SwiGLU fc1 reassembled as
         [gate_0..gate_{n-1}; up_0..up_{n-1}]); a parameter that TP does not split is taken as it is.
      2. EP (experts): the EP rank holding X broadcasts it over the stage's EP group when every other member
         needs it, else sends it to those that do.
      3. PP: stage s's rank sends X along its pipeline group to the members that receive (a broadcast when all
         other stages receive).
    A rank "needs" X after step 3 when it receives, after step 2 when a rank of its pipeline group receives,
    after step 1 when a rank of its EP group needs it after step 2 (experts). With `receive` on the rollout
    ranks only (model-parallel rank 0 of each data-parallel rank: TP rank 0 of pipeline stage 0), a TP peer
    or a later stage relays one tensor at a time and never holds a bucket; EP peers are data-parallel ranks
    that generate too (with ETP < TP an EP peer may be a TP peer that does not: it then relays, too).

    Memory. A receiving rank holds the current bucket (<= bucket_bytes) and, from its first use to the end
    of the pass, one staging buffer the size of the largest TP-split tensor of its stage, which receives the
    shards of tensors split on dim 1 (row-parallel) and of the SwiGLU fc1 before they are reordered into the
    bucket (shards split on dim 0, e.g. the vocab-parallel embedding, land in place): at most bucket_bytes + the
    largest tensor. A relaying rank holds one tensor at a time (plus what the backend buffers inside a
    collective: gloo flattens a gather's outputs; NCCL's gather and all_gather_single write in place).
    Each bucket's dict is emptied when the next bucket is asked for, so only one bucket is alive even while a
    consumer still holds the previous dict: copy what you keep (`list(buckets)` gives empty dicts). Tensors
    are on the model's device; where no gather was needed (TP does not split it, this rank's stage and EP rank
    hold it) a tensor SHARES STORAGE with the parameter (zero copy): read it, do not write it or keep it past
    the next optimizer step (`copy=True` clones those).

    Collective: every rank of the model's TP, expert-TP, EP and pipeline groups builds it at the same time
    (the metadata exchange runs in the constructor) and iterates it to the end, also when it does not
    receive and also when its consumer fails part-way (drain the rest first; stopping early leaves the other
    ranks waiting). One pass only.
    """

    def __init__(self, model, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, *, receive: bool = True,
                 tensors: dict[str, torch.Tensor] | None = None, coords: RankCoordinates | None = None,
                 copy: bool = False, dims: ParallelDims | None = None) -> None:
        """`dims`: the run's process layout (moe.parallel.ParallelDims), whose ranks and groups are used;
        without it they are read from Megatron's parallel_state."""
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool)
                                         or bucket_bytes < 1):
            raise ValueError(f"bucket_bytes must be a positive integer (bytes) or None, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.receive = bool(receive)
        self.copy = copy
        self.coords = coords = coords or (RankCoordinates.of(dims) if dims is not None else RankCoordinates.current())
        self._params = dict(model.named_parameters())
        self._tensors = tensors
        first = next(iter(self._params.values()), None)
        if first is not None:
            self.device = first.device
        else:
            self.device = model_device()
        self.stage, self._groups = _stage_and_groups(dims)
        self._members = {kind: _group_ranks(group) for kind, group in self._groups.items()}
        dist = torch.distributed
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

        # 1. pipeline group: each stage's part of the plan and who receives
        mine = _stage_plan(model, coords, self.stage, tensors)
        pp = self._exchange("pp", (self.stage, self.receive, mine))
        self._stage_of = {m: s for m, (s, _, _) in zip(self._members["pp"], pp)}
        self._receives = {m: r for m, (_, r, _) in zip(self._members["pp"], pp)}
        plan: list[BucketEntry] = []
        held: dict[str, int] = {}
        for s, _, part in sorted(pp, key=lambda x: x[0]):
            for entry in part:
                if entry.name in held:
                    raise RuntimeError(f"full state: {entry.name} is held by pipeline stages {held[entry.name]} "
                                       f"and {s}")
                held[entry.name] = s
                plan.append(entry)
        self.plan = plan
        digest = hashlib.sha1(repr(plan).encode()).hexdigest()
        pp_need = any(self._receives.values())  # a rank of my pipeline group receives
        # 2. EP group: who needs a stage's tensors (step 2), each member's EP rank
        ep = self._exchange("ep", (pp_need, coords.ep_rank, digest))
        self._ep_need = {m: n for m, (n, _, _) in zip(self._members["ep"], ep)}
        self._ep_rank_of = {m: r for m, (_, r, _) in zip(self._members["ep"], ep)}
        ep_need = any(self._ep_need.values())  # experts I hold must be assembled (step 1)
        # 3. TP and expert-TP groups: who needs the assembled tensors
        tp = self._exchange("tp", (pp_need, digest))
        self._tp_need = {m: n for m, (n, _) in zip(self._members["tp"], tp)}
        etp = self._exchange("etp", (ep_need, digest))
        self._etp_need = {m: n for m, (n, _) in zip(self._members["etp"], etp)}
        for kind, infos in (("expert-parallel", ep), ("tensor-parallel", tp), ("expert-tensor-parallel", etp)):
            if any(info[-1] != digest for info in infos):
                raise RuntimeError(f"full state: the ranks of this {kind} group built different sync plans "
                                   "(different models or layouts?); refusing to start mismatched collectives")
        self.buckets: list[list[BucketEntry]] = _cut(plan, bucket_bytes)
        self._used = False
        self._stage: torch.Tensor | None = None  # receive buffer for TP shards (`_staging`)

    # ---------------------------------------------------------------------------------------------- plan
    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def bucket_names(self) -> list[list[str]]:
        return [[e.name for e in bucket] for bucket in self.buckets]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.plan)

    # ---------------------------------------------------------------------------------------------- moving
    def __iter__(self):
        if self._used:
            raise RuntimeError("FullStateBuckets is a single pass (its collectives run once): build a new one")
        self._used = True
        return self._generate()

    @torch.no_grad()
    def _generate(self):
        try:
            for bucket in self.buckets:
                out: dict[str, torch.Tensor] = {}
                for entry in bucket:
                    t = self._move(entry)
                    if t is not None:
                        out[entry.name] = t
                    del t
                yield out
                out.clear()  # free this bucket before the next is gathered, whoever still holds the dict
        finally:
            self._stage = None

    def _move(self, entry: BucketEntry) -> torch.Tensor | None:
        me = self._rank
        t = local = None
        if entry.stage == self.stage:
            expert = entry.expert_owner is not None
            if not expert or self.coords.ep_rank == entry.expert_owner:
                source = self._params[entry.local_name] if self._tensors is None else self._tensors[entry.local_name]
                local = source.detach()
                t = self._assemble(local, entry, "etp" if expert else "tp",
                                   self._etp_need if expert else self._tp_need)
            if expert:
                src = next(m for m in self._members["ep"] if self._ep_rank_of[m] == entry.expert_owner)
                needers = [m for m in self._members["ep"] if m != src and self._ep_need[m]]
                t = self._forward(t, src, needers, "ep", entry)
        src = next(m for m in self._members["pp"] if self._stage_of[m] == entry.stage)
        needers = [m for m in self._members["pp"] if m != src and self._receives[m]]
        t = self._forward(t if me == src else None, src, needers, "pp", entry)
        if not self.receive:
            return None
        if t is None:
            raise RuntimeError(f"full state: {entry.name} did not reach receiving rank {me} (a bug in the plan)")
        if self.copy and local is not None and t is local:
            t = t.clone()
        return t

    def _assemble(self, local: torch.Tensor, entry: BucketEntry, kind: str, need: dict) -> torch.Tensor | None:
        """Step 1: the full tensor from its TP (expert-TP) shards, on the members of the group that need it."""
        me, members = self._rank, self._members[kind]
        if entry.split == 1:
            return local if need[me] else None
        if entry.split != len(members):
            raise RuntimeError(f"full state: {entry.name} is split {entry.split} ways, its {kind} group has "
                               f"{len(members)} ranks")
        needers = [m for m in members if need[m]]
        if not needers:
            return None
        local, group, dim, n = local.contiguous(), self._groups[kind], entry.partition_dim, len(members)
        # Shards on dim 0 (vocab-parallel embedding / output layer, column-parallel qkv) land straight in the
        # full tensor: its dim-0 chunks are contiguous views. The others (row-parallel dim 1, the SwiGLU fc1's
        # [gate_r; up_r]) land in the staging buffer and are reordered into a new tensor; a rank that must
        # take part in an all_gather without needing the result also receives into the staging buffer.
        direct = dim == 0 and not entry.glu
        if need[me] and direct:
            out = torch.empty(entry.shape, dtype=local.dtype, device=local.device)
        elif need[me] or len(needers) > 1:
            out = self._staging(entry, local)
        else:
            out = None  # a gather's non-destination
        if len(needers) == 1:
            torch.distributed.gather(local, list(out.chunk(n)) if out is not None else None, dst=needers[0],
                                     group=group)
        else:
            _all_gather_single(out, local, group)
        if not need[me]:
            return None
        if direct:
            return out
        parts = out.chunk(n)
        if entry.glu:
            halves = [torch.chunk(p, 2, dim=dim) for p in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
        return torch.cat(parts, dim=dim)

    def _staging(self, entry: BucketEntry, local: torch.Tensor) -> torch.Tensor:
        """A [split * shard rows, ...] receive buffer for `entry`'s shards: a view of one flat byte buffer that
        lives for the pass, sized at first use for the largest TP-split tensor of this stage (one allocation
        instead of one per tensor)."""
        nbytes = entry.nbytes
        if self._stage is None:
            self._stage = torch.empty(max(e.nbytes for e in self.plan if e.stage == self.stage and e.split > 1),
                                      dtype=torch.uint8, device=local.device)
        rows = local.shape[0] * entry.split
        return self._stage[:nbytes].view(local.dtype).view((rows,) + tuple(local.shape[1:]))

    def _forward(self, t: torch.Tensor | None, src: int, needers: list, kind: str,
                 entry: BucketEntry) -> torch.Tensor | None:
        """Steps 2 and 3: `src` (which holds t) passes it to `needers` over the group; returns it where held."""
        me = self._rank
        if me == src and t is None and needers:
            raise RuntimeError(f"full state: {entry.name} is not assembled on rank {me}, which must pass it on")
        if not needers:
            return t if me == src else None
        members, group = self._members[kind], self._groups[kind]
        everyone = len(needers) == len(members) - 1
        if me == src:
            t = t.contiguous()
            if everyone:
                torch.distributed.broadcast(t, src=src, group=group)
            else:
                for m in needers:
                    torch.distributed.send(t, dst=m, group=group)
            return t
        if me not in needers:
            return None
        buf = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device=self.device)
        if everyone:
            torch.distributed.broadcast(buf, src=src, group=group)
        else:
            torch.distributed.recv(buf, src=src, group=group)
        return buf

    def _exchange(self, kind: str, obj) -> list:
        """obj from every member of the group, in group order (no communication in a group of one)."""
        if len(self._members[kind]) == 1:
            return [obj]
        out: list = [None] * len(self._members[kind])
        torch.distributed.all_gather_object(out, obj, group=self._groups[kind])
        return out


def _stage_and_groups(dims: ParallelDims | None) -> tuple[int, dict]:
    """This rank's pipeline stage and its TP / expert-TP / EP / PP groups: from `dims`, else Megatron's
    parallel_state."""
    if dims is not None:
        return dims.pp_rank, {"tp": dims.tp_group, "etp": dims.etp_group, "ep": dims.ep_group, "pp": dims.pp_group}
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank(), {
        "tp": ps.get_tensor_model_parallel_group(), "etp": ps.get_expert_tensor_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group()}


def _stage_plan(model, coords: RankCoordinates, stage: int, tensors) -> list[BucketEntry]:
    """This pipeline stage's tensors in sync order (identical on its TP and EP ranks)."""
    gated = bool(getattr(model.config, "gated_linear_unit", True))
    num_local_experts = _num_local_experts(model, coords)
    offset = layer_offset(model)
    names = full_names(model, coords)
    out: list[BucketEntry] = []
    for local_name, param in model.named_parameters():
        if is_tied_embedding_copy(model, local_name):
            continue  # a duplicate of the first stage's embedding
        t = param if tensors is None else tensors[local_name]
        expert = is_expert_param(local_name)
        size = coords.etp_size if expert else coords.tp_size
        split = size if getattr(param, "tensor_model_parallel", False) and size > 1 else 1
        dim = int(param.partition_dim) if split > 1 else None
        shape = [int(d) for d in t.shape]
        if split > 1:
            shape[dim] *= split
        dtype = str(t.dtype).removeprefix("torch.")
        glu = split > 1 and gated and local_name.endswith("linear_fc1.weight")
        if expert:
            for r in range(coords.ep_size):
                name = local_to_full_name(local_name, replace(coords, ep_rank=r), num_local_experts, offset)
                out.append(BucketEntry(name, tuple(shape), dtype, stage, local_name, r, split, dim, glu))
        else:
            out.append(BucketEntry(names[local_name], tuple(shape), dtype, stage, local_name, None, split, dim, glu))
    return out


def _cut(plan: list[BucketEntry], cap: int | None) -> list[list[BucketEntry]]:
    """Consecutive runs of `plan` of at most `cap` bytes; a bigger tensor alone; None: one bucket."""
    if cap is None:
        return [list(plan)] if plan else []
    buckets: list[list[BucketEntry]] = []
    used = 0
    for entry in plan:
        n = entry.nbytes
        if not buckets or (buckets[-1] and used + n > cap):
            buckets.append([])
            used = 0
        buckets[-1].append(entry)
        used += n
    return buckets


def _group_ranks(group) -> list[int]:
    """Global ranks of `group`, in group-rank order ([this rank] without a process group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    ranks = dist.get_process_group_ranks(group)
    return sorted(ranks, key=lambda r: dist.get_group_rank(group, r))


def _all_gather_single(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """All ranks' `t` concatenated on dim 0 into `out` (torch >= 2.13 names it all_gather_single)."""
    dist = torch.distributed
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)
