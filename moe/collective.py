"""Work that happens once, on rank 0, with every rank learning the outcome.

Generating rollouts, scoring them, choosing the checkpoint to resume, opening its folder, sending weights to
the rollout servers: one rank does the work and its peers must receive the result — or, when the work
fails, fail too, instead of waiting forever in the next collective for a rank that has already raised.
"""

from __future__ import annotations

import pickle
from typing import Callable, Optional, Type, TypeVar

import torch

from moe import cuda_calls
T = TypeVar("T")


def collective_device(group=None) -> torch.device:
    """Where a tensor handed to a collective on `group` must live: the current CUDA device under NCCL (which
    takes no CPU tensors), the CPU under gloo or without a process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", cuda_calls.current_cuda_device())
    return torch.device("cpu")


def sum_over(values, group) -> list:
    """Python numbers summed elementwise over the ranks of `group` (float64), as a list of floats; a group of
    one (or no process group) returns them unchanged."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, group=group)
    return t.tolist()


def max_over(values, group) -> list:
    """Python numbers, each the largest over the ranks of `group` (None: every process), as floats."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_on_rank0(what: str, fn: Callable[[], T], group=None, peer_error: Optional[Type[Exception]] = None) -> T:
    """fn() on rank 0 of `group` (None: every process) only, its result broadcast to the group (it must
    pickle). If fn raises, rank 0 broadcasts the error instead and re-raises it; each peer raises
    `peer_error` (default: the same exception type, RuntimeError where that type cannot be rebuilt from one
    message) with a message naming the failure on rank 0. Without a process group, or in a group of one, it
    is just fn()."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return fn()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box, error = [None], None
    if dist.get_rank(group) == 0:
        try:
            box = [(True, fn())]
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers are told
            error, cls = exc, peer_error or type(exc)
            try:
                pickle.loads(pickle.dumps(cls))  # an unpicklable class would fail the broadcast on rank 0
            except Exception:  # noqa: BLE001
                cls = RuntimeError
            box = [(False, (cls, f"{type(exc).__name__}: {exc}"))]
    dist.broadcast_object_list(box, src=src, group=group)
    ok, payload = box[0]
    if error is not None:
        raise error
    if ok:
        return payload
    cls, message = payload
    where = "rank 0 of its group" if group is not None else "rank 0"
    message = f"{what} failed on {where} (global rank {src}): {message}"
    try:
        peer = cls(message)
    except Exception:  # noqa: BLE001 - a type that is not built from one message
        peer = None
    raise peer if isinstance(peer, Exception) else RuntimeError(message)


__all__ = ["collective_device", "run_on_rank0", "sum_over"]
