"""The trainer's stream of Megatron buckets re-cut into the buckets an in-memory sync sends (tensor and
distributed): HF tensors in arrival order under a byte cap, the last one held until the stream has ended, so
that only the final bucket flushes the servers' cache, and only once every HF tensor has come exactly once.
Pure tensor bookkeeping: the senders (tensor_sync.py, distributed_sync.py) do the I/O."""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import torch

from moe.hf_checkpoint import PER_EXPERT, hf_tensor_shapes

from ..weight_sync import hf_named_tensors_of_bucket, plan_buckets


def server_buckets(buckets: Iterator[Dict[str, torch.Tensor]], count: Optional[int], arch, cap: int,
                   dtype: Optional[torch.dtype]):
    """Yields (k, n, pairs, last) per server bucket, `pairs` the HF (name, tensor) pairs of bucket k (0-based) in
    arrival order (HF state-dict order within each incoming bucket; a whole state dict thus goes out in HF
    order), cast to `dtype` when given, under `cap` bytes and one dtype per bucket (plan_buckets), `n` the
    number of server buckets once known (None before), `last` on the final one. Converted tensors wait in
    `pending` until a full bucket forms; the last bucket is held until the stream ends (or its `count` incoming
    buckets have come), and sent only when the stream held every HF tensor exactly once (else KeyError, before
    the flush). Holds at most: the incoming bucket, its HF tensors, and less than one server bucket carried
    over."""
    expected = hf_tensor_shapes(arch, PER_EXPERT)
    seen: set = set()
    pending: list = []
    k = 0

    def sizes(pairs):
        return [(n, t.dtype, t.numel() * t.element_size()) for n, t in pairs]

    def check_complete():
        missing = [name for name in expected if name not in seen]
        if missing:
            raise KeyError(f"weight sync: the stream lacked {len(missing)} HF tensor(s), e.g. {missing[:5]} "
                           f"(the servers hold {k} updated bucket(s) of this sync; nothing was flushed)")

    for i, bucket in enumerate(buckets):
        named = hf_named_tensors_of_bucket(bucket, arch, dtype)
        del bucket
        repeated = [name for name, _ in named if name in seen]
        if repeated:
            raise ValueError(f"weight sync: the stream holds {repeated[:5]} more than once")
        seen.update(name for name, _ in named)
        pending.extend(named)
        del named
        final = count is not None and i == count - 1
        plan = plan_buckets(sizes(pending), cap) if pending else []
        if final:
            check_complete()
        ready = plan if final else plan[:-1]  # the last one may still grow, or be the update's last
        n = k + len(plan) if final else None
        for j, idx in enumerate(ready):
            yield k, n, [pending[x] for x in idx], final and j == len(plan) - 1
            k += 1
        pending = [] if final else [pending[x] for x in plan[-1]] if plan else []
        if final:
            return
    check_complete()
    plan = plan_buckets(sizes(pending), cap) if pending else []
    for j, idx in enumerate(plan):
        yield k, k - j + len(plan), [pending[x] for x in idx], j == len(plan) - 1
        k += 1


def bucket_label(b: int, n: Optional[int], pairs) -> str:
    """How an error names server bucket b of n (n None: not known yet)."""
    of = f"/{n}" if n is not None else ""
    return f"bucket {b + 1}{of} ({pairs[0][0]} .. {pairs[-1][0]}, {len(pairs)} tensors)"
