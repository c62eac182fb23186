"""Full (TP=EP=1) Megatron GPTModel state dict -> Hugging Face Qwen3MoeForCausalLM state dict, in memory:
what the embedded engine loads after every update. The layout mapping lives in one place,
`moe.hf_checkpoint` (the same table that imports and exports HF checkpoints); this only adapts it to
`Qwen3MoeForCausalLM.load_state_dict`, which wants `lm_head.weight` even when it is tied to the embedding.

Also the pieces of the SGLang in-memory weight sync that need no server (sglang_engine.py drives them): HF
tensors in send order, buckets under a byte cap, names/dtypes/shapes, and the trainer's side of SGLang's
weight-update process group (rendezvous + broadcasts).
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch


def megatron_to_hf_state_dict(full: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    from moe.hf_checkpoint import FUSED, hf_state_dict_from_megatron

    out = hf_state_dict_from_megatron({name: t.detach() for name, t in full.items()}, arch, expert_layout=FUSED)
    if arch.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ------------------------------------------------------------------------------------- in-memory sync to SGLang
# What SGLang's update endpoints are fed (sglang_engine.py posts them): HF tensor names in the per-expert layout
# (what SGLang's Qwen3-MoE load_weights maps onto its fused / stacked parameters), cut into buckets.

def hf_named_tensors_for_sync(full: Dict[str, torch.Tensor], arch, dtype: Optional[torch.dtype] = None
                              ) -> List[Tuple[str, torch.Tensor]]:
    """The full Megatron state as (HF name, tensor) in HF state-dict order, per-expert layout, cast to `dtype`
    when given (SGLang's weight loader copies into its own dtype; casting first halves a bf16 server's traffic)."""
    from moe.hf_checkpoint import PER_EXPERT, hf_state_dict_from_megatron

    hf = hf_state_dict_from_megatron({name: t.detach() for name, t in full.items()}, arch, expert_layout=PER_EXPERT)
    return [(k, t if dtype is None or t.dtype == dtype else t.to(dtype)) for k, t in hf.items()]


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


def bucket_metadata(named: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[List[str], List[str], List[List[int]]]:
    """names, dtype names ("bfloat16") and shapes of a bucket, as /update_weights_from_distributed wants them."""
    from .sglang_schema import dtype_name

    return ([n for n, _ in named], [dtype_name(t.dtype) for _, t in named], [list(t.shape) for _, t in named])


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
