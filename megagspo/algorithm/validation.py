"""Input checks for the algorithm core, kept apart from the math so the losses can skip them.

Every check here may synchronise with the device (it inspects values); the losses call them only when
`validate=True`. Messages name the tensor and its shape so a bad batch is found from the log alone.

Legend (docs/architecture.md): T packed tokens, N packed sequences (spelled `_S` in names here; `_S1`: the N + 1 offsets).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _shape(x: Tensor) -> str:
    return f"{tuple(x.shape)} ({x.dtype})"


def check_1d(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (packed layout), got shape {_shape(x)}")


def check_same_shape(ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    for name, x in others.items():
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != ref.shape:
            raise ValueError(f"{name} has shape {_shape(x)} but {ref_name} has shape {_shape(ref)}; they must match")


def check_float(name: str, x: Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_shape(x)}")


def check_cu_seqlens(cu_seqlens_S1: Tensor, num_tokens: int, num_sequences: Optional[int] = None) -> None:
    """cu_seqlens_S1: integer, 1-D, starts at 0, non-decreasing, last == T (and length S+1 when S is known)."""
    check_1d("cu_seqlens_S1", cu_seqlens_S1)
    if cu_seqlens_S1.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens_S1 must be int32 or int64, got {_shape(cu_seqlens_S1)}")
    if cu_seqlens_S1.numel() < 1:
        raise ValueError("cu_seqlens_S1 is empty; it needs at least the leading 0 (length S+1)")
    if num_sequences is not None and cu_seqlens_S1.numel() != num_sequences + 1:
        raise ValueError(
            f"cu_seqlens_S1 has length {cu_seqlens_S1.numel()} but there are {num_sequences} sequences "
            f"(advantages); it must have length S+1 = {num_sequences + 1}"
        )
    cu = cu_seqlens_S1.detach().cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_S1 must start at 0, got {cu[:4].tolist()}...")
    steps = cu.diff()
    if bool((steps < 0).any()):
        bad = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"cu_seqlens_S1 must be non-decreasing; cu_seqlens_S1[{bad}]={int(cu[bad])} > "
            f"cu_seqlens_S1[{bad + 1}]={int(cu[bad + 1])}"
        )
    if int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens_S1 ends at {int(cu[-1])} but the packed tensors hold T={num_tokens} tokens; "
            "the last offset must equal T"
        )


def check_mask(name: str, mask: Tensor) -> None:
    if mask.dtype == torch.bool:
        return
    if mask.is_floating_point() or mask.dtype in (torch.int32, torch.int64, torch.uint8, torch.int8):
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{name} must hold only 0/1 (or be bool), got other values; shape {_shape(mask)}")
        return
    raise TypeError(f"{name} must be bool or 0/1 numeric, got {_shape(mask)}")


def check_finite(name: str, x: Tensor, where_T: Optional[Tensor] = None) -> None:
    """Non-finite values are rejected only where they would count (`where_T`): positions outside the
    response mask never reach the loss, so prompt padding may hold anything."""
    bad = ~torch.isfinite(x)
    if where_T is not None:
        bad = bad & where_T
    if bool(bad.any()):
        idx = torch.nonzero(bad.reshape(-1))[:5].flatten().tolist()
        vals = x.detach().reshape(-1)[idx].tolist()
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) at counted positions (first flat indices {idx}: "
            f"{vals}); shape {_shape(x)}"
        )


def check_num_global(name: str, value, local_count: int) -> None:
    v = value.detach().cpu().item() if isinstance(value, Tensor) else value
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive count, got {value!r}")
    if v < local_count:
        raise ValueError(
            f"{name}={v} is smaller than this micro-batch's {local_count}; it must count the whole global "
            "batch (all micro-batches and data-parallel ranks)"
        )


def require_positive_finite(owner: str, field: str, value, *, allow_zero: bool = True) -> None:
    """Config-field check whose message names the dataclass, field and value."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{field} must be a finite number {bound}, got {value!r}")


def require_choice(owner: str, field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{field} must be one of {sorted(choices)}, got {value!r}")
