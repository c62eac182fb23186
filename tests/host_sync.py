"""Test-only helpers (holds no tests itself): `HostSyncDetector`, which records every place where code run
inside it would make the host wait for the device, on any device, the CPU included.

    with HostSyncDetector() as detector:
        out = layer(hidden)
        out.backward(grad)
    detector.assert_none("the MoE layer at EP = 1")     # or inspect detector.events

Two kinds of host synchronisation, two ways of seeing them:

1. aten ops that read device values on the host or size their output from them. A `TorchDispatchMode` sees
   every aten op (forward and the autograd engine's backward alike) and records those in HOST_READ_OPS
   (`_local_scalar_dense` is item / int / float / bool / `if t:` / `range(t)` / indexing a list with a tensor,
   `nonzero` is also argwhere and one-argument where, `_unique2` is unique, ...) and the conditional ones:
   `repeat_interleave` without `output_size`, indexing or index_put with a boolean mask, a copy between two
   devices that is not `non_blocking`, and an op mixing CUDA tensors with CPU tensors of more than one element
   (an implicit transfer).
2. Host-side readers that reach no dispatch mode (measured on torch 2.13's CPU build): `Tensor.tolist`,
   `Tensor.numpy` / `__array__` (only a `detach` is dispatched), `Tensor.cpu` (no op at all for a CPU tensor,
   so on the CPU it is invisible to (1)), `torch.cuda.synchronize`, and `synchronize` of CUDA streams and
   events, including moe.cpu_shim's stand-ins for them, on which Megatron's dispatcher waits for its
   device-to-host copy on a CUDA-less host. These are patched for the detector's scope, every call recorded.
   `.cpu()` is recorded even for a tensor already on the host: code under test here has no reason to call it.

Not seen: `Tensor.to("cpu")` of a CPU tensor (a no-op, indistinguishable from `.to(device)` on a CPU test; on
CUDA it is the cross-device copy of (1)), `repr` / `str` of a tensor, and waits inside C++ extensions. On CUDA,
`torch.cuda.set_sync_debug_mode("error")` is the driver-level check; this detector runs on both.

Each event names the op and the innermost frames outside torch and this file (file:line function).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten op packets whose every call reads device values on the host
HOST_READ_OPS = frozenset({
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.allclose",
    "aten.nonzero", "aten.nonzero_numpy", "aten.masked_select", "aten.argwhere",
    "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.unique_dim_consecutive",
    "aten.bincount", "aten.histc",
})
_MASK_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_",
                             "aten._unsafe_index", "aten._unsafe_index_put"})
_COPY_OPS = frozenset({"aten._to_copy", "aten.copy_", "aten.copy", "aten._copy_from"})
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True)
class HostSyncEvent:
    what: str     # the aten op or the patched host-side reader
    where: str    # innermost frames outside torch and this file, innermost first

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


def _caller_frames(depth: int = 3) -> str:
    frames = [f for f in traceback.extract_stack()
              if not f.filename.startswith(_TORCH_DIR) and os.path.abspath(f.filename) != _THIS_FILE]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-depth:]))


def _short(path: str) -> str:
    for marker in ("site-packages/", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _tensors(args, kwargs):
    stack = [*args, *(kwargs or {}).values()]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def host_read_reason(func, args, kwargs) -> str | None:
    """Why the aten call `func(*args, **kwargs)` makes the host wait for the device, or None."""
    name = str(func.overloadpacket)
    kwargs = kwargs or {}
    if name in HOST_READ_OPS:
        return name
    if name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
        return f"{name} without output_size"
    if name in _MASK_INDEX_OPS and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        return f"{name} with a boolean mask"
    tensors = list(_tensors(args, kwargs))
    if name in _COPY_OPS and not kwargs.get("non_blocking", False):
        devices = {t.device for t in tensors}
        if "device" in kwargs and kwargs["device"] is not None:
            devices.add(torch.device(kwargs["device"]))
        if len(devices) > 1:
            return f"{name} between {sorted(str(d) for d in devices)} (blocking)"
    if any(t.is_cuda for t in tensors) and any(t.device.type == "cpu" and t.numel() > 1 for t in tensors):
        return f"{name} mixes CUDA tensors with CPU tensors (an implicit transfer)"
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, detector: "HostSyncDetector"):
        super().__init__()
        self.detector = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reason = host_read_reason(func, args, kwargs)
        if reason is not None:
            self.detector.record(reason)
        return func(*args, **(kwargs or {}))


def _sync_classes() -> list:
    """The classes whose `synchronize` blocks the host: CUDA streams and events, and, where moe.cpu_shim
    replaced torch.cuda.Stream, its stand-in stream and the event class that stand-in records."""
    classes = [torch.cuda.Event, torch.cuda.Stream, torch.cuda.streams.Stream, torch.cuda.streams.Event]
    if torch.cuda.Stream is not torch.cuda.streams.Stream:  # the CPU shim's stand-ins (CUDA-less host)
        classes.append(type(torch.cuda.Stream().record_event()))
    unique = []
    for cls in classes:
        if cls not in unique and "synchronize" in dir(cls):
            unique.append(cls)
    return unique


class HostSyncDetector(contextlib.AbstractContextManager):
    """Records every host synchronisation (see the module docstring) made inside `with`; `events` lists them."""

    def __init__(self):
        self.events: list[HostSyncEvent] = []
        self._stack: contextlib.ExitStack | None = None

    def record(self, what: str) -> None:
        self.events.append(HostSyncEvent(what, _caller_frames()))

    def _reader(self, what: str, original):
        def read(*args, **kwargs):
            self.record(what)
            return original(*args, **kwargs)
        return read

    def __enter__(self):
        stack = contextlib.ExitStack()
        for name in ("tolist", "numpy", "__array__", "cpu"):
            stack.enter_context(mock.patch.object(torch.Tensor, name,
                                                  self._reader(f"Tensor.{name}", getattr(torch.Tensor, name))))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize",
                                              self._reader("torch.cuda.synchronize", torch.cuda.synchronize)))
        for cls in _sync_classes():
            stack.enter_context(mock.patch.object(cls, "synchronize",
                                                  self._reader(f"{cls.__name__}.synchronize", cls.synchronize)))
        stack.enter_context(_Recorder(self))
        self._stack = stack
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self._stack = None
        return False

    def assert_none(self, what: str) -> None:
        assert not self.events, (f"{what}: {len(self.events)} host synchronisation(s):\n"
                                 + "\n".join(f"  {e}" for e in self.events))
