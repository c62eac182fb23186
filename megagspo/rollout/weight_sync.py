"""Full (TP=EP=1) Megatron GPTModel tensors -> Hugging Face Qwen3MoeForCausalLM tensors, in memory: what the
rollout engines are fed after every update. The layout mapping lives in one place, `moe.hf_checkpoint` (the
same table of row segments that imports and exports HF checkpoints); this adapts it to the engines.

Weights arrive as a stream of buckets (partial full-model state dicts, `moe.sharding.iter_full_state_buckets`;
a whole state dict is a stream of one bucket). A bucket may hold any subset of the Megatron tensors, e.g. some
of a layer's experts only, so nothing here needs a whole layer: `HFParamWriter` copies each Megatron tensor's
row segments straight into the embedded model's parameters (one expert's slice of the fused
`gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` at a time, cast to the model's dtype), and
`hf_named_tensors_of_bucket` makes the per-expert HF tensors SGLang loads from the bucket alone.

Also the pieces of the SGLang in-memory weight sync that need no server (the package `sglang/` drives them):
HF tensors in send order, buckets under a byte cap, and the trainer's side of SGLang's weight-update process
group (rendezvous + broadcasts). This module imports nothing from `sglang/` (which imports it).
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from moe.hf_checkpoint import FUSED, PER_EXPERT, hf_state_dict_from_megatron, hf_tensor_shapes, megatron_plan


def megatron_to_hf_state_dict(full: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    """The whole HF state dict (fused experts) of a full Megatron state dict, `lm_head.weight` included even
    when tied (what `Qwen3MoeForCausalLM.load_state_dict` wants). Holds a second copy of the model: the engines
    take buckets instead (`HFParamWriter`); this stays for callers that want the dict."""
    out = hf_state_dict_from_megatron({name: t.detach() for name, t in full.items()}, arch, expert_layout=FUSED)
    if arch.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _megatron_plan(arch, expert_layout: str):
    """moe.hf_checkpoint's table for `arch` (full Megatron name -> shape and HF row segments); with tied
    embeddings `output_layer.weight` is left out (a copy of the embedding: skipped when a bucket carries it)."""
    plan = megatron_plan(arch, expert_layout)
    if arch.tie_word_embeddings:
        plan.pop("output_layer.weight")
    return plan


def _check_megatron_tensor(name: str, t: torch.Tensor, plan, arch) -> bool:
    """False for a tensor to skip (the tied embedding's copy); raises for a name or shape the table lacks."""
    entry = plan.get(name)
    if entry is None:
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return False
        raise KeyError(f"weight sync: {name!r} (shape {tuple(t.shape)}) is not a tensor of this Qwen3-MoE "
                       "architecture")
    if tuple(t.shape) != entry.shape:
        raise ValueError(f"weight sync: {name} has shape {tuple(t.shape)}, the architecture expects {entry.shape}")
    return True


class HFParamWriter:
    """Copies full Megatron tensors, bucket by bucket, into a transformers Qwen3MoeForCausalLM (fused experts):
    each row segment of `moe.hf_checkpoint.megatron_plan` goes straight into its slice of the HF parameter
    (`param[expert][rows]` for the fused expert tensors), cast to the parameter's dtype and device by `copy_`;
    no HF tensor is ever assembled. `finish()` checks that every element of every parameter was written
    exactly once over the whole stream (a tensor missing from, or repeated in, the stream raises naming it).
    A tied `lm_head` shares the embedding's parameter, so writing the embedding writes it."""

    def __init__(self, model, arch) -> None:
        self.arch = arch
        self.plan = _megatron_plan(arch, FUSED)
        params = dict(model.named_parameters())
        self.params = {}
        for key, shape in hf_tensor_shapes(arch, FUSED).items():
            p = params.get(key)
            if p is None or tuple(p.shape) != tuple(shape):
                raise RuntimeError(f"HF weight sync: the engine's model has {key} "
                                   f"{'missing' if p is None else tuple(p.shape)}, the architecture wants {shape}")
            self.params[key] = p
        self.written = {key: 0 for key in self.params}

    @torch.no_grad()
    def write(self, bucket: Dict[str, torch.Tensor]) -> None:
        for name, t in bucket.items():
            if not _check_megatron_tensor(name, t, self.plan, self.arch):
                continue
            t = t.detach()
            offset = 0
            for seg in self.plan[name].segments:
                param = self.params[seg.hf_key]
                target = param if seg.expert is None else param[seg.expert]
                piece = t[offset:offset + seg.rows]
                target[seg.start:seg.stop].copy_(piece)
                self.written[seg.hf_key] += piece.numel()
                offset += seg.rows

    def finish(self) -> None:
        wrong = [f"{k} ({n} of {self.params[k].numel()} elements written)" for k, n in self.written.items()
                 if n != self.params[k].numel()]
        if wrong:
            raise RuntimeError(f"HF weight sync: {len(wrong)} parameter(s) not written exactly once: "
                               + ", ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))


def hf_named_tensors_of_bucket(bucket: Dict[str, torch.Tensor], arch, dtype: Optional[torch.dtype] = None,
                               expert_layout: Optional[str] = None) -> List[Tuple[str, torch.Tensor]]:
    """The HF tensors (per-expert layout by default, what SGLang's Qwen3-MoE loader maps) made of a bucket's
    Megatron tensors, in HF state-dict order, cast to `dtype` when given. In the per-expert layout every HF
    tensor is made of row segments of ONE Megatron tensor (q/k/v of `linear_qkv`, gate/up of an fc1), so any
    bucket converts on its own; an HF tensor only partly covered by the bucket (the fused layout's
    `gate_up_proj` with some experts missing) raises. A tensor that is one whole segment is a view of the
    Megatron tensor (no copy unless cast)."""
    layout = expert_layout or PER_EXPERT
    plan = _megatron_plan(arch, layout)
    shapes = hf_tensor_shapes(arch, layout)
    pieces: Dict[str, list] = {}
    for name, t in bucket.items():
        if not _check_megatron_tensor(name, t, plan, arch):
            continue
        t = t.detach()
        offset = 0
        for seg in plan[name].segments:
            if seg.expert is not None:
                raise ValueError(f"weight sync: {seg.hf_key} ({layout} layout) stacks several Megatron tensors; "
                                 "send per-expert tensors")
            pieces.setdefault(seg.hf_key, []).append((seg.start, t[offset:offset + seg.rows]))
            offset += seg.rows
    order = {k: i for i, k in enumerate(shapes)}
    out = []
    for key in sorted(pieces, key=order.__getitem__):
        parts = sorted(pieces[key], key=lambda x: x[0])
        covered = 0
        for start, piece in parts:
            covered = covered + piece.shape[0] if start == covered else -1
        if covered != shapes[key][0]:
            raise ValueError(f"weight sync: the bucket holds rows {[(a, a + p.shape[0]) for a, p in parts]} of "
                             f"{key} (shape {shapes[key]}), not each row once")
        t = parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts])
        out.append((key, t if dtype is None or t.dtype == dtype else t.to(dtype)))
    return out


# ------------------------------------------------------------------------------------- in-memory sync to SGLang
# What SGLang's update endpoints are fed (sglang/tensor_sync.py and sglang/distributed_sync.py post them): HF
# tensor names in the per-expert layout (what SGLang's Qwen3-MoE load_weights maps onto its fused / stacked
# parameters), cut into buckets.

def hf_named_tensors_for_sync(full: Dict[str, torch.Tensor], arch, dtype: Optional[torch.dtype] = None
                              ) -> List[Tuple[str, torch.Tensor]]:
    """The full Megatron state as (HF name, tensor) in HF state-dict order, per-expert layout, cast to `dtype`
    when given (SGLang's weight loader copies into its own dtype; casting first halves a bf16 server's traffic)."""
    named = hf_named_tensors_of_bucket(full, arch, dtype)
    missing = [k for k in hf_tensor_shapes(arch, PER_EXPERT) if k not in {n for n, _ in named}]
    if missing:
        raise KeyError(f"weight sync: the state lacks the Megatron tensors of {len(missing)} HF tensor(s), e.g. "
                       f"{missing[:5]}")
    return named


def plan_buckets(sizes: Sequence[Tuple[str, torch.dtype, int]], cap_bytes: int) -> List[List[int]]:
    """Indices of consecutive tensors grouped into buckets of at most `cap_bytes`, one dtype per bucket (a
    flattened bucket holds one dtype in older SGLang versions). `sizes` = (name, dtype, nbytes) in send order;
    a tensor bigger than the cap travels alone. Order is preserved: concatenating the buckets gives 0..n-1."""
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
    buckets: List[List[int]] = []
    used, dtype = 0, None
    for i, (_, dt, nbytes) in enumerate(sizes):
        if not buckets or dt != dtype or used + nbytes > cap_bytes:
            buckets.append([])
            used, dtype = 0, dt
        buckets[-1].append(i)
        used += nbytes
    return buckets


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                             backend: str, timeout_s: float):
    """Join the process group SGLang's /init_weights_update_group builds (model_runner.init_weights_update_group ->
    init_custom_process_group): a rendezvous at tcp://master_address:master_port (rank 0, the trainer, hosts the
    store), the store prefixed with `group_name`, a `backend` group of `world_size` ranks outside the default
    one. Uses torch's private _new_process_group_helper, as SGLang itself does; a torch that changed it fails here
    with a message naming it."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    try:
        store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                       timeout=timeout))
        store.set_timeout(timeout)
        store = c10d.PrefixStore(group_name, store)
        params = inspect.signature(c10d._new_process_group_helper).parameters
        options = "backend_options" if "backend_options" in params else "pg_options"
        group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                                  group_name=group_name, timeout=timeout, **{options: None})
    except (AttributeError, TypeError) as exc:
        raise RuntimeError(f"this torch ({torch.__version__}) has no usable "
                           f"torch.distributed.distributed_c10d._new_process_group_helper ({exc})") from None
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_bucket(tensors: Sequence[torch.Tensor], group) -> list:
    """Start one broadcast(src=0) per tensor, in order, on `group` (what SGLang's receiving side posts); returns
    the works to wait on."""
    import torch.distributed as dist

    return [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
