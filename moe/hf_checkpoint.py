"""Hugging Face Qwen3-MoE safetensors <-> Megatron-Core GPTModel parameters, at any TP / EP / ETP / PP layout.

One table drives both directions: every full-model (TP=EP=PP=1) Megatron tensor is a stack, along its
dim 0, of row ranges of HF tensors (`Segment`s). Examples, for layer i (HF prefix `model.layers.i.`):

    decoder.layers.i.self_attention.linear_qkv.weight  [(nh + 2 nkv) d, H]
        = for each KV group g: [q_proj rows of g's heads (nh/nkv * d); k_proj rows g*d..; v_proj rows g*d..]
    decoder.layers.i.mlp.linear_fc1.weight (dense)      [2 F, H] = [mlp.gate_proj; mlp.up_proj]
    ...mlp.experts.local_experts.e.linear_fc1.weight    [2 I, H] = mlp.experts.gate_up_proj[e]  (5.x fused:
        [E, 2I, H], gate rows first — transformers' own per-expert -> fused converter concatenates
        gate then up) or [mlp.experts.e.gate_proj; mlp.experts.e.up_proj] (per-expert layout)
    ...mlp.experts.local_experts.e.linear_fc2.weight    [H, I]  = mlp.experts.down_proj[e] ([E, H, I]) or
        mlp.experts.e.down_proj
    decoder.layers.i.mlp.router.weight [E, H] = mlp.gate.weight; pre_mlp_layernorm = post_attention_layernorm

Import (`load_hf_checkpoint`): each rank works out, for each of its parameters, which rows and columns
of the full Megatron tensor it owns (TP rows or columns; the SwiGLU fc1 shard is [gate_r; up_r]; its
experts; its pipeline stage's layers), maps them through the segments, and reads exactly those slices
with `safe_open(...).get_slice(...)`. Peak memory: the rank's shard plus one slice. The whole key set
and every full shape are validated from the safetensors headers first, before any data is read.

Export (`save_hf_checkpoint`): the full tensors are gathered to the writer rank in buckets by
`moe.sharding.iter_full_state_buckets` (the one shard -> full gather, also the trainer's weight sync) and
handed to `HFFolderWriter` (the one HF folder writer, also the SGLang engine's disk weight sync), which makes
each HF tensor once the Megatron tensors it is built of have arrived (e.g. one layer's experts for a fused
`gate_up_proj`) and appends it to the current safetensors shard; the writer holds one bucket, those
pending tensors and one output shard. Output: `model.safetensors` or `model-0000k-of-0000n.safetensors`
with `model.safetensors.index.json`, plus `config.json`; experts per-expert by default (as transformers'
`save_pretrained` writes them), fused on request.

Usage (every rank, after `initialize_model_parallel`):

    arch = architecture_from_hf_config(hf_dir)             # moe.hf_config; strict about keys
    model = build_model(arch, layout)                       # moe.model
    load_hf_checkpoint(model, hf_dir)                       # reads this rank's slices only
    ...
    save_hf_checkpoint(model, out_dir, arch)                # collective; rank 0 writes

Shape legend: E experts, H hidden, I moe_intermediate_size, F intermediate_size (dense layers),
d head_dim, nh / nkv query / KV heads, V vocabulary.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from moe.architecture import Qwen3MoeArchitecture
from moe.checkpoint_errors import CheckpointError  # re-exported: callers import it from here too
from moe.hf_config import architecture_from_hf_config, hf_config_from_architecture
from moe.json_files import JsonFileError, read_json
from moe.sharding import DEFAULT_BUCKET_BYTES, RankCoordinates, iter_full_state_buckets

FUSED = "fused"  # transformers 5.x: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
PER_EXPERT = "per_expert"  # transformers 4.x / hub checkpoints: mlp.experts.{e}.{gate,up,down}_proj.weight
EXPERT_LAYOUTS = (FUSED, PER_EXPERT)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def is_hf_model_folder(path: str | os.PathLike) -> bool:
    """True when `path` is a Hugging Face model folder: a config.json beside `model.safetensors` or the
    index of a sharded checkpoint (what `save_pretrained` and `megagspo export` write)."""
    folder = Path(path)
    return folder.is_dir() and (folder / "config.json").is_file() and \
        ((folder / SAFE_WEIGHTS).is_file() or (folder / SAFE_INDEX).is_file())


# --------------------------------------------------------------------------------------------------------
# The table: full Megatron tensors as row segments of HF tensors
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of an HF tensor (of expert `expert` of a fused [E, ...] tensor, if set)."""

    hf_key: str
    start: int
    stop: int
    expert: int | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class MegatronTensor:
    name: str  # full-model Megatron name (global layer and expert indices)
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]


def _whole(key: str, rows: int) -> tuple[Segment, ...]:
    return (Segment(key, 0, rows),)


def hf_tensor_shapes(arch: Qwen3MoeArchitecture, expert_layout: str = FUSED) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3MoeForCausalLM checkpoint and its shape, in HF state-dict order."""
    _check_layout(expert_layout)
    H, d, E, I = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_intermediate_size
    nh, nkv = arch.num_attention_heads, arch.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, H)}
    for i, is_moe in enumerate(arch.moe_layer_pattern):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * d, H),
            p + "self_attn.k_proj.weight": (nkv * d, H),
            p + "self_attn.v_proj.weight": (nkv * d, H),
            p + "self_attn.o_proj.weight": (H, nh * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        })
        if is_moe:
            if expert_layout == FUSED:
                shapes[p + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
                shapes[p + "mlp.experts.down_proj"] = (E, H, I)
            else:
                for e in range(E):
                    shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
                    shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (I, H)
                    shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (H, I)
            shapes[p + "mlp.gate.weight"] = (E, H)
        else:
            F = arch.intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (F, H)
            shapes[p + "mlp.up_proj.weight"] = (F, H)
            shapes[p + "mlp.down_proj.weight"] = (H, F)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, H)
    return shapes


def megatron_plan(arch: Qwen3MoeArchitecture, expert_layout: str = FUSED) -> dict[str, MegatronTensor]:
    """Every full-model Megatron parameter (local layer spec names), its shape and its HF segments.

    With tied embeddings `output_layer.weight` (a parameter only on the last stage of PP>1) maps to
    `model.embed_tokens.weight`.
    """
    _check_layout(expert_layout)
    H, d, E, I = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_intermediate_size
    nh, nkv = arch.num_attention_heads, arch.num_key_value_heads
    heads_per_group = nh // nkv
    plan: dict[str, MegatronTensor] = {}

    def add(name, shape, segments):
        assert sum(s.rows for s in segments) == shape[0], name
        plan[name] = MegatronTensor(name, tuple(shape), tuple(segments))

    add("embedding.word_embeddings.weight", (arch.vocab_size, H), _whole("model.embed_tokens.weight", arch.vocab_size))
    for i, is_moe in enumerate(arch.moe_layer_pattern):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        add(m + "input_layernorm.weight", (H,), _whole(p + "input_layernorm.weight", H))
        qkv = []
        for g in range(nkv):
            qkv.append(Segment(p + "self_attn.q_proj.weight", g * heads_per_group * d, (g + 1) * heads_per_group * d))
            qkv.append(Segment(p + "self_attn.k_proj.weight", g * d, (g + 1) * d))
            qkv.append(Segment(p + "self_attn.v_proj.weight", g * d, (g + 1) * d))
        add(m + "self_attention.linear_qkv.weight", ((nh + 2 * nkv) * d, H), qkv)
        add(m + "self_attention.linear_proj.weight", (H, nh * d), _whole(p + "self_attn.o_proj.weight", H))
        add(m + "self_attention.q_layernorm.weight", (d,), _whole(p + "self_attn.q_norm.weight", d))
        add(m + "self_attention.k_layernorm.weight", (d,), _whole(p + "self_attn.k_norm.weight", d))
        add(m + "pre_mlp_layernorm.weight", (H,), _whole(p + "post_attention_layernorm.weight", H))
        if is_moe:
            add(m + "mlp.router.weight", (E, H), _whole(p + "mlp.gate.weight", E))
            for e in range(E):
                fc1, fc2 = m + f"mlp.experts.local_experts.{e}.linear_fc1.weight", \
                    m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"
                if expert_layout == FUSED:
                    add(fc1, (2 * I, H), (Segment(p + "mlp.experts.gate_up_proj", 0, 2 * I, e),))
                    add(fc2, (H, I), (Segment(p + "mlp.experts.down_proj", 0, H, e),))
                else:
                    q = p + f"mlp.experts.{e}."
                    add(fc1, (2 * I, H), (Segment(q + "gate_proj.weight", 0, I), Segment(q + "up_proj.weight", 0, I)))
                    add(fc2, (H, I), _whole(q + "down_proj.weight", H))
        else:
            F = arch.intermediate_size
            add(m + "mlp.linear_fc1.weight", (2 * F, H),
                (Segment(p + "mlp.gate_proj.weight", 0, F), Segment(p + "mlp.up_proj.weight", 0, F)))
            add(m + "mlp.linear_fc2.weight", (H, F), _whole(p + "mlp.down_proj.weight", H))
    add("decoder.final_layernorm.weight", (H,), _whole("model.norm.weight", H))
    head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    add("output_layer.weight", (arch.vocab_size, H), _whole(head, arch.vocab_size))
    return plan


def _check_layout(expert_layout: str) -> None:
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")


_FUSED_KEY = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.")


def detect_expert_layout(keys: Iterable[str]) -> str:
    """FUSED or PER_EXPERT from checkpoint key names (FUSED when there are no expert tensors)."""
    keys = list(keys)
    fused = [k for k in keys if _FUSED_KEY.search(k)]
    per_expert = [k for k in keys if _PER_EXPERT_KEY.search(k)]
    if fused and per_expert:
        raise CheckpointError(
            f"checkpoint mixes fused expert tensors ({fused[0]!r}...) and per-expert tensors ({per_expert[0]!r}...)"
        )
    return PER_EXPERT if per_expert else FUSED


def _cut(name: str, limit: int = 200) -> str:
    """A tensor or file name read from a checkpoint, cut for an error message (the file is user input)."""
    return name if len(name) <= limit else f"{name[:limit]}... ({len(name)} characters)"


def validate_hf_tensors(actual: Mapping[str, tuple[int, ...]], arch: Qwen3MoeArchitecture,
                        expert_layout: str) -> None:
    """Raise CheckpointError listing every missing, wrongly shaped or unexpected tensor with both shapes."""
    expected = hf_tensor_shapes(arch, expert_layout)
    problems = []
    for key, shape in expected.items():
        if key not in actual:
            problems.append(f"{key}: expected shape {shape}, missing from the checkpoint (shape: none)")
        elif tuple(actual[key]) != shape:
            problems.append(f"{key}: expected shape {shape}, checkpoint has shape {tuple(actual[key])}")
    for key, shape in actual.items():
        if key in expected:
            continue
        if key == "lm_head.weight" and arch.tie_word_embeddings and tuple(shape) == expected["model.embed_tokens.weight"]:
            continue  # some tied checkpoints store the head anyway; the embedding is authoritative
        problems.append(f"{_cut(key)}: unexpected tensor of shape {tuple(shape)} (expected: no such tensor "
                        f"for this architecture, {expert_layout} expert layout)")
    if problems:
        shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise CheckpointError(f"checkpoint does not match the architecture ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(shown))


# --------------------------------------------------------------------------------------------------------
# Tensor sources: a directory of safetensors files, or an in-memory HF state dict
# --------------------------------------------------------------------------------------------------------


class _Source:
    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def read(self, key: str, expert: int | None, rows: tuple[int, int], cols: tuple[int, int] | None) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _DictSource(_Source):
    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def shapes(self):
        return {k: tuple(v.shape) for k, v in self.tensors.items()}

    def read(self, key, expert, rows, cols):
        t = self.tensors[key]
        if expert is not None:
            t = t[expert]
        t = t[rows[0]:rows[1]]
        return t if cols is None else t[:, cols[0]:cols[1]]


class SafetensorsSource(_Source):
    """The tensors of a checkpoint directory (single `model.safetensors`, or sharded with its index).

    Only headers are read on construction; `read` loads one slice through `get_slice`.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / SAFE_INDEX
        if index.is_file():
            try:
                parsed = read_json(index, want=None)
            except JsonFileError as exc:
                raise CheckpointError(str(exc)) from None
            weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: no 'weight_map' mapping of tensor names to shard files")
            files = sorted(set(weight_map.values()))
            for name in files:  # a shard is a file of this folder: never a path that leaves it
                if not name or "/" in name or name in (".", "..") or "\0" in name or len(name) > 255:
                    raise CheckpointError(f"{index}: names shard {_cut(name)!r}, which is not a file name in "
                                          f"{self.path} (no '/', not '.' or '..', at most 255 characters)")
        elif (self.path / SAFE_WEIGHTS).is_file():
            weight_map, files = None, [SAFE_WEIGHTS]
        else:
            raise CheckpointError(f"{self.path}: neither {SAFE_WEIGHTS} nor {SAFE_INDEX} found")
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"{index}: names shard {_cut(name)!r}, which does not exist")
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a bad header
                first_line = (str(exc).strip().splitlines() or [""])[0][:200]
                raise CheckpointError(f"{file}: not a readable safetensors file ({type(exc).__name__}: "
                                      f"{first_line})") from None
            self._handles[name] = handle
            for key in handle.keys():
                if key in self._file_of:
                    raise CheckpointError(f"tensor {_cut(key)!r} is stored twice ({self._file_of[key]} and "
                                          f"{name})")
                self._file_of[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self._file_of.get(key) != name:
                    raise CheckpointError(f"{SAFE_INDEX} maps {_cut(key)!r} to {_cut(name)!r}, but that shard does "
                                          "not hold it")
            for key, name in self._file_of.items():
                if key not in weight_map:
                    raise CheckpointError(f"shard {name!r} holds {_cut(key)!r}, which {SAFE_INDEX} does not list")

    def shapes(self):
        return {k: tuple(self._handles[f].get_slice(k).get_shape()) for k, f in self._file_of.items()}

    def read(self, key, expert, rows, cols):
        view = self._handles[self._file_of[key]].get_slice(key)
        rank = len(view.get_shape())
        index = [] if expert is None else [expert]
        index.append(slice(*rows))
        if rank - len(index) == 1:
            index.append(slice(None) if cols is None else slice(*cols))
        return view[tuple(index)]

    def tensor(self, key):
        """The whole tensor `key` (one at a time: the file is memory-mapped)."""
        return self._handles[self._file_of[key]].get_tensor(key)

    def close(self):
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_rows_cols(entry: MegatronTensor, source: _Source, row_ranges, cols) -> torch.Tensor:
    """Rows `row_ranges` (list of [a, b) of the full Megatron tensor) and columns `cols` of `entry`."""
    pieces = []
    for a, b in row_ranges:
        offset = 0
        for seg in entry.segments:
            lo, hi = max(a, offset), min(b, offset + seg.rows)
            if lo < hi:
                pieces.append(source.read(seg.hf_key, seg.expert, (seg.start + lo - offset, seg.start + hi - offset), cols))
            offset += seg.rows
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


# --------------------------------------------------------------------------------------------------------
# Local (rank) parameters <-> full Megatron names and the slice of the full tensor each owns
# --------------------------------------------------------------------------------------------------------

# Transformer Engine spec aliases of the local-spec names (the norm fused into the next linear, grouped experts).
_TE_ALIASES = (
    (re.compile(r"^(.*)\.self_attention\.linear_qkv\.layer_norm_weight$"), r"\1.input_layernorm.weight"),
    (re.compile(r"^(.*)\.mlp\.linear_fc1\.layer_norm_weight$"), r"\1.pre_mlp_layernorm.weight"),
    (re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$"), r"\1.local_experts.\3.\2.weight"),
)
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class LocalParam:
    local_name: str
    full_name: str
    param: torch.Tensor
    expert: bool
    split_dim: int | None  # the TP / ETP partition dim, None when this rank holds the whole tensor
    rank: int  # position in the TP (or ETP for experts) group
    size: int  # TP (or ETP) group size
    glu: bool  # SwiGLU fc1: the shard is [gate_r; up_r]


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder") and not hasattr(model, "embedding"):
        model = model.module
    return model


def _chunks(model) -> list:
    return [_unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def local_params(model, arch: Qwen3MoeArchitecture, coords: RankCoordinates | None = None) -> list[LocalParam]:
    """This rank's parameters with their full-model names and how each is split (all model chunks)."""
    coords = coords or RankCoordinates.current()
    if arch.num_experts % coords.ep_size:
        raise CheckpointError(f"num_experts={arch.num_experts} is not divisible by EP size {coords.ep_size}")
    num_local_experts = arch.num_experts // coords.ep_size
    out = []
    for chunk in _chunks(model):
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        global_layer = [int(layer.layer_number) - 1 for layer in layers]
        for local_name, param in chunk.named_parameters():
            name = local_name
            for pattern, repl in _TE_ALIASES:
                name = pattern.sub(repl, name)
            match = _LOCAL_LAYER.match(name)
            if match:
                name = f"decoder.layers.{global_layer[int(match[1])]}.{match[2]}"
            match = _LOCAL_EXPERT.match(name)
            if match:
                name = f"{match[1]}{coords.ep_rank * num_local_experts + int(match[2])}{match[3]}"
            expert = match is not None
            rank, size = (coords.etp_rank, coords.etp_size) if expert else (coords.tp_rank, coords.tp_size)
            split = getattr(param, "tensor_model_parallel", False) and size > 1
            out.append(LocalParam(local_name, name, param, expert, int(param.partition_dim) if split else None,
                                  rank if split else 0, size if split else 1, name.endswith("linear_fc1.weight")))
    return out


def _owned_ranges(lp: LocalParam, full_shape: tuple[int, ...]):
    """(row ranges, column range or None) of the full tensor that `lp` holds."""
    rows = full_shape[0]
    if lp.split_dim is None:
        return [(0, rows)], None
    if lp.split_dim == 0:
        if lp.glu:
            half = rows // 2
            step = half // lp.size
            return [(lp.rank * step, (lp.rank + 1) * step), (half + lp.rank * step, half + (lp.rank + 1) * step)], None
        step = rows // lp.size
        return [(lp.rank * step, (lp.rank + 1) * step)], None
    if lp.split_dim == 1:
        step = full_shape[1] // lp.size
        return [(0, rows)], (lp.rank * step, (lp.rank + 1) * step)
    raise CheckpointError(f"{lp.local_name}: partition_dim {lp.split_dim} is not supported")


def _split_is_exact(lp: LocalParam, full_shape) -> bool:
    if lp.split_dim is None:
        return True
    extent = full_shape[lp.split_dim] // (2 if lp.glu and lp.split_dim == 0 else 1)
    return extent % lp.size == 0


# --------------------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------------------

_COMPARED_FIELDS_EXCLUDED = {"initializer_range", "router_aux_loss_coef", "max_position_embeddings"}


def _check_config_matches(path: Path, arch: Qwen3MoeArchitecture) -> None:
    if not (path / "config.json").is_file():
        return
    stored = architecture_from_hf_config(path)
    diffs = [f"{f}: model {getattr(arch, f)!r}, checkpoint config.json {getattr(stored, f)!r}"
             for f in Qwen3MoeArchitecture.field_names()
             if f not in _COMPARED_FIELDS_EXCLUDED and getattr(arch, f) != getattr(stored, f)]
    if diffs:
        raise CheckpointError(f"{path}/config.json describes another architecture:\n  " + "\n  ".join(diffs))


@torch.no_grad()
def load_hf_checkpoint(model, path: str | os.PathLike, arch: Qwen3MoeArchitecture | None = None,
                       coords: RankCoordinates | None = None) -> dict:
    """Copy this rank's slices of the HF checkpoint at `path` into `model` (a GPTModel or its PP chunks).

    `arch` defaults to the checkpoint's config.json (when given, config.json must agree with it). Every
    rank validates the full key set and shapes from the headers (CheckpointError naming each tensor and
    both shapes), then reads only the slices it owns. Returns a small report (layout, tensors, bytes read).
    """
    path = Path(path)
    if arch is None:
        arch = architecture_from_hf_config(path)
    else:
        _check_config_matches(path, arch)
    with SafetensorsSource(path) as source:
        return _load_from_source(model, source, arch, coords)


@torch.no_grad()
def load_hf_state_dict(model, hf_state_dict: Mapping[str, torch.Tensor], arch: Qwen3MoeArchitecture,
                       coords: RankCoordinates | None = None) -> dict:
    """`load_hf_checkpoint` from an in-memory HF state dict (e.g. `Qwen3MoeForCausalLM.state_dict()`)."""
    return _load_from_source(model, _DictSource(hf_state_dict), arch, coords)


def inspect_hf_checkpoint(path: str | os.PathLike, arch: Qwen3MoeArchitecture) -> tuple[str, dict]:
    """(expert layout, {key: shape}) of the checkpoint at `path`, from headers only; raises CheckpointError
    naming every missing, wrongly shaped or unexpected tensor with both shapes, or each field where its
    config.json describes another architecture. The same checks `load_hf_checkpoint` makes, without reading
    a weight."""
    _check_config_matches(Path(path), arch)
    with SafetensorsSource(path) as source:
        shapes = source.shapes()
    layout = detect_expert_layout(shapes)
    validate_hf_tensors(shapes, arch, layout)
    return layout, shapes


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN / +-inf: min / max propagate NaN and show +-inf, in one reduction with no
    tensor-sized temporary (torch.isfinite(...).all() on bf16 is 35-50x slower on a CPU:
    benchmarks/bench_finite_check.py)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def first_nonfinite_hf_tensor(path: str | os.PathLike) -> str | None:
    """The first tensor (by name) of the HF folder `path` holding a NaN or an infinity, else None: every
    tensor read whole, one at a time, in its stored dtype, and checked with one aminmax. For the dry run's
    --check-weights; a run checks each slice when it reads it (after the cast to the run's precision)."""
    with SafetensorsSource(path) as source:
        for key in sorted(source.shapes()):
            if not all_finite(source.tensor(key)):
                return key
    return None


def _check_finite(piece: torch.Tensor, entry: MegatronTensor, lp) -> None:
    """CheckpointError naming the tensor when a weight read from the checkpoint is NaN or infinite: such a
    model trains to nothing, writes the bad value into every checkpoint and fails far from its cause.
    Measured cost in docs/robustness.md: ~0.07 s per GiB of bf16 on one CPU thread, less than copying the
    bytes in."""
    if all_finite(piece):
        return
    bad = int((~torch.isfinite(piece)).sum())
    keys = sorted({seg.hf_key for seg in entry.segments})
    shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
    raise CheckpointError(f"{shown}: {bad} of {piece.numel()} values read for {lp.full_name} are NaN or "
                          "infinite; a model cannot start from non-finite weights")


def _load_from_source(model, source: _Source, arch, coords) -> dict:
    shapes = source.shapes()
    layout = detect_expert_layout(shapes)
    validate_hf_tensors(shapes, arch, layout)
    plan = megatron_plan(arch, layout)
    params = local_params(model, arch, coords)
    bytes_read = elements_read = 0
    for lp in params:
        entry = plan.get(lp.full_name)
        if entry is None:
            raise CheckpointError(f"model parameter {lp.local_name!r} (full name {lp.full_name!r}, shape "
                                  f"{tuple(lp.param.shape)}) has no counterpart in a Qwen3-MoE checkpoint")
        if not _split_is_exact(lp, entry.shape):
            raise CheckpointError(f"{lp.full_name}: full shape {entry.shape} does not split {lp.size} ways "
                                  f"on dim {lp.split_dim}")
        rows, cols = _owned_ranges(lp, entry.shape)
        piece = _read_rows_cols(entry, source, rows, cols)
        if tuple(piece.shape) != tuple(lp.param.shape):
            raise CheckpointError(
                f"{lp.full_name}: checkpoint slice has shape {tuple(piece.shape)}, local parameter "
                f"{lp.local_name} has shape {tuple(lp.param.shape)} (full tensor {entry.shape})"
            )
        lp.param.copy_(piece)
        _check_finite(lp.param, entry, lp)  # after the cast: a value the run's precision cannot hold shows too
        bytes_read += piece.numel() * piece.element_size()
        elements_read += piece.numel()
        del piece
    return {"expert_layout": layout, "parameters": len(params), "elements_read": elements_read,
            "bytes_read": bytes_read}


def megatron_state_dict_from_hf(hf_state_dict: Mapping[str, torch.Tensor], arch: Qwen3MoeArchitecture) -> dict:
    """The full (TP=EP=PP=1) Megatron state dict of an in-memory HF state dict (validated first)."""
    source = _DictSource(hf_state_dict)
    shapes = source.shapes()
    layout = detect_expert_layout(shapes)
    validate_hf_tensors(shapes, arch, layout)
    plan = megatron_plan(arch, layout)
    if arch.tie_word_embeddings:
        plan.pop("output_layer.weight")
    return {name: _read_rows_cols(e, source, [(0, e.shape[0])], None).clone() for name, e in plan.items()}


def hf_state_dict_from_megatron(full: Mapping[str, torch.Tensor], arch: Qwen3MoeArchitecture,
                                expert_layout: str = FUSED) -> dict[str, torch.Tensor]:
    """The HF state dict of a full (TP=EP=PP=1) Megatron state dict."""
    plan = megatron_plan(arch, expert_layout)
    if arch.tie_word_embeddings:
        plan.pop("output_layer.weight")
    hf_shapes = hf_tensor_shapes(arch, expert_layout)
    out: dict[str, torch.Tensor] = {}
    for unit in _units(plan, hf_shapes):
        out.update(_unit_to_hf(unit, {n: full[n] for n in unit.megatron}, plan, hf_shapes))
    return out


# --------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Unit:
    hf: tuple[str, ...]  # HF tensors produced together
    megatron: tuple[str, ...]  # the Megatron tensors they are made of


def _units(plan: dict[str, MegatronTensor], hf_shapes: dict[str, tuple]) -> list[_Unit]:
    """Connected groups of (HF tensors, Megatron tensors), in HF state-dict order."""
    users: dict[str, list[str]] = {}
    for name, entry in plan.items():
        for seg in entry.segments:
            users.setdefault(seg.hf_key, [])
            if name not in users[seg.hf_key]:
                users[seg.hf_key].append(name)
    done: set[str] = set()
    units = []
    for key in hf_shapes:
        if key in done:
            continue
        hf_keys, mg_names, stack = [], [], [key]
        while stack:
            k = stack.pop()
            if k in done:
                continue
            done.add(k)
            hf_keys.append(k)
            for name in users.get(k, []):
                if name in mg_names:
                    continue
                mg_names.append(name)
                stack.extend(s.hf_key for s in plan[name].segments if s.hf_key not in done)
        order = {k: i for i, k in enumerate(hf_shapes)}
        units.append(_Unit(tuple(sorted(hf_keys, key=order.__getitem__)), tuple(mg_names)))
    return units


def _unit_to_hf(unit: _Unit, tensors: Mapping[str, torch.Tensor], plan, hf_shapes) -> dict[str, torch.Tensor]:
    dtype = next(iter(tensors.values())).dtype
    out = {k: torch.empty(hf_shapes[k], dtype=dtype) for k in unit.hf}
    filled = {k: 0 for k in unit.hf}
    for name in unit.megatron:
        full = tensors[name]
        entry = plan[name]
        if tuple(full.shape) != entry.shape:
            raise CheckpointError(f"{name}: gathered shape {tuple(full.shape)}, architecture expects {entry.shape}")
        offset = 0
        for seg in entry.segments:
            target = out[seg.hf_key] if seg.expert is None else out[seg.hf_key][seg.expert]
            target[seg.start:seg.stop].copy_(full[offset:offset + seg.rows])
            filled[seg.hf_key] += seg.rows * (full[0].numel() if full.dim() > 1 else 1)
            offset += seg.rows
    for key, count in filled.items():
        if count != out[key].numel():
            raise CheckpointError(f"{key}: export covered {count} of {out[key].numel()} elements")
    return out


class _ShardWriter:
    """Appends tensors to safetensors shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""

    def __init__(self, path: Path, max_shard_bytes: int):
        self.path, self.max = path, max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max:
            self._flush()
        self.current[key] = tensor.contiguous()
        self.current_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f".tmp-shard-{len(self.files):05d}.safetensors"
        save_file(self.current, str(self.path / name), metadata={"format": "pt"})
        self.files.append((name, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> list[str]:
        if self.current or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.path / self.files[0][0], self.path / SAFE_WEIGHTS)
            return [SAFE_WEIGHTS]
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.path / tmp, self.path / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names + [SAFE_INDEX]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HFFolderWriter:
    """The one writer of Hugging Face Qwen3-MoE folders: full (TP=EP=PP=1) Megatron tensors in, in any number
    of buckets (a whole state dict is one bucket); safetensors shards, their index and config.json out.

    Each HF tensor is made (`_unit_to_hf`) as soon as every Megatron tensor it is built of has arrived (one
    Megatron tensor in the per-expert layout; every expert of a layer for the fused one) and appended to the
    current shard, so the writer holds one output shard plus the Megatron tensors of unfinished HF tensors,
    on the CPU. `dtype`: cast every tensor to it (None keeps each tensor's dtype). `finish` checks that the
    stream covered every HF tensor, gives the shards their final names (`model.safetensors`, or
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`) and writes config.json with the
    embedding's dtype. Used by `save_hf_checkpoint` (export of a distributed model) and by the SGLang
    engine's disk weight sync (a stream of `moe.sharding` buckets)."""

    def __init__(self, path: str | os.PathLike, arch: Qwen3MoeArchitecture, *, expert_layout: str = PER_EXPERT,
                 dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
                 config_extra: Mapping | None = None) -> None:
        _check_layout(expert_layout)
        self.path, self.arch, self.dtype, self.config_extra = Path(path), arch, dtype, config_extra
        self.plan = megatron_plan(arch, expert_layout)
        if arch.tie_word_embeddings:
            self.plan.pop("output_layer.weight")  # the last stage's copy of the embedding; the embedding is written
        self.hf_shapes = hf_tensor_shapes(arch, expert_layout)
        self._unit_of = {name: unit for unit in _units(self.plan, self.hf_shapes) for name in unit.megatron}
        self._pending: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()  # Megatron tensors already written
        self._config_dtype: torch.dtype | None = None
        self._shards = _ShardWriter(self.path, max_shard_bytes)

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Full Megatron tensors by full name; `output_layer.weight` of a tied model is skipped."""
        for name, t in tensors.items():
            unit = self._unit_of.get(name)
            if unit is None:
                if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                    continue
                raise CheckpointError(f"{name!r} (shape {tuple(t.shape)}) has no counterpart in a Qwen3-MoE "
                                      "checkpoint")
            if name in self._pending or name in self._done:
                raise CheckpointError(f"{self.path}: the tensors hold {name} more than once")
            self._pending[name] = t.detach().cpu()
            if all(n in self._pending for n in unit.megatron):
                self._write(unit)

    def _write(self, unit: _Unit) -> None:
        parts = {n: self._pending.pop(n) for n in unit.megatron}
        self._done.update(unit.megatron)
        for key, tensor in _unit_to_hf(unit, parts, self.plan, self.hf_shapes).items():
            if key == "model.embed_tokens.weight":
                self._config_dtype = self.dtype or tensor.dtype
            self._shards.add(key, tensor if self.dtype is None else tensor.to(self.dtype))

    def finish(self) -> list[str]:
        """-> the files written (shards, index, config.json)."""
        missing = [n for n in self.plan if n not in self._done]
        if missing:
            raise CheckpointError(f"{self.path}: the tensors lacked {len(missing)} Megatron tensor(s) of this "
                                  f"architecture, e.g. {missing[:5]}")
        files = self._shards.finish()
        config = hf_config_from_architecture(self.arch, dtype=_dtype_name(self._config_dtype),
                                             extra=self.config_extra)
        (self.path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return files + ["config.json"]


@torch.no_grad()
def save_hf_checkpoint(model, path: str | os.PathLike, arch: Qwen3MoeArchitecture, *,
                       expert_layout: str = PER_EXPERT, dtype: torch.dtype | None = None,
                       max_shard_bytes: int = 5 * 2**30, writer_rank: int = 0,
                       coords: RankCoordinates | None = None, overwrite: bool = False,
                       config_extra: Mapping | None = None) -> list[str]:
    """Write `model` (any layout; every rank must call) as an HF checkpoint in `path` on `writer_rank`.

    Tensors are written in `dtype` (default: the embedding's dtype, i.e. the model's params_dtype), experts in `expert_layout`:
    PER_EXPERT by default — what transformers 5.23's own `save_pretrained` writes, what published Qwen3
    checkpoints hold and what SGLang / vLLM loaders read; transformers 5.x loads it (fusing on load) as well
    as FUSED (`gate_up_proj [E, 2I, H]`, its in-memory layout). The full tensors come from the one
    shard -> full gather, `moe.sharding.iter_full_state_buckets`, delivered to the writer rank only, in buckets
    of at most min(max_shard_bytes, 512 MiB), into `HFFolderWriter`. Returns the files written (on the writer;
    [] elsewhere). Raises CheckpointError (on every rank) if the model's parameters do not cover the
    architecture.
    """
    import torch.distributed as dist

    _check_layout(expert_layout)
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if distributed else 0
    plan = megatron_plan(arch, expert_layout)
    if arch.tie_word_embeddings:
        plan.pop("output_layer.weight")  # the last stage's copy of the embedding; the embedding is written
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise CheckpointError(f"save_hf_checkpoint takes one model chunk, got {len(chunks)} (virtual pipeline "
                              "stages are not supported)")
    for lp in local_params(model, arch, coords):
        if lp.full_name not in plan and not (lp.full_name == "output_layer.weight" and arch.tie_word_embeddings):
            raise CheckpointError(f"model parameter {lp.local_name!r} (full name {lp.full_name!r}) has no "
                                  "counterpart in a Qwen3-MoE checkpoint")

    buckets = iter_full_state_buckets(chunks[0], min(max_shard_bytes, DEFAULT_BUCKET_BYTES),
                                      receive=me == writer_rank, coords=coords)
    # The gather's plan is the whole model's (every stage, every expert) and the same on every rank of the
    # model-parallel groups, so these checks fail on all of them together, before any tensor moves.
    held = {_hf_name(e.name): e for e in buckets.plan}
    missing = [n for n in plan if n not in held]
    if missing:
        raise CheckpointError(f"no rank holds (all shards of) {len(missing)} tensor(s), e.g. {missing[:5]}")
    # One dtype for the whole file: the embedding's (the model's params_dtype; Megatron's torch-norm
    # fallback keeps norm gains in float32 under bf16, which converts back exactly).
    out_dtype = dtype or getattr(torch, held["embedding.word_embeddings.weight"].dtype)

    writer, failure = None, None
    if me == writer_rank:
        path.mkdir(parents=True, exist_ok=True)
        stale = sorted(p.name for p in path.glob("*.safetensors")) + \
            ([SAFE_INDEX] if (path / SAFE_INDEX).exists() else [])
        if stale and not overwrite:
            failure = CheckpointError(f"{path} already holds {stale}; pass overwrite=True to replace them")
        else:
            for name in stale:
                (path / name).unlink()
            writer = HFFolderWriter(path, arch, expert_layout=expert_layout, dtype=out_dtype,
                                    max_shard_bytes=max_shard_bytes, config_extra=config_extra)
    for bucket in buckets:  # every rank iterates to the end (the gather is collective), also after a failure
        if writer is not None and failure is None:
            try:
                writer.add({_hf_name(name): t for name, t in bucket.items()})
            except CheckpointError as exc:
                failure = exc
    if failure is not None:
        raise failure
    return writer.finish() if writer is not None else []


def _hf_name(full_name: str) -> str:
    """A full Megatron name under the local spec's spelling (Transformer Engine's fused-norm names mapped)."""
    for pattern, repl in _TE_ALIASES:
        full_name = pattern.sub(repl, full_name)
    return full_name
