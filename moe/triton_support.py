"""The one guard of the optional Triton dependency (moe.triton_wgrad, moe.triton_swiglu import `triton` / `tl`
from here and define their kernels only where it imported).

Triton comes with torch's CUDA builds (the GPU image: torch 2.11 with triton 3.6); on a CPU host it is pinned in
requirements/base.txt (3.7.1) for its interpreter only: with TRITON_INTERPRET=1 in the environment BEFORE the
kernel modules are imported (triton.jit reads it when it decorates), every kernel runs in numpy on CPU tensors, so
the CPU tests check the kernels' indexing, masking and arithmetic (tests/test_moe_triton_kernels.py runs them in a
child process that sets it). Triton 3.6's interpreter fails with numpy 2.4 in loops whose bounds are loaded from
memory (a TypeError, measured 2026-11-30), hence 3.7.1 on the CPU. Measured there too: the interpreter's `tl.dot`
on bf16 operands returns garbage (fp16 and fp32 are right), so bf16 is checked on a GPU only.

A kernel choice that cannot run here fails with ImplementationError naming the choice, never a silent fallback.
"""

from __future__ import annotations

import os

import torch

from moe.implementation import ImplementationError

try:  # optional: absent on a CPU install without requirements/base.txt's pin
    import triton
    import triton.language as tl
    TRITON_IMPORT_ERROR = None
except ImportError as exc:
    if exc.name is None or exc.name.split(".")[0] != "triton":
        raise  # triton is there but something it imports is broken: not hidden
    triton = tl = None
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


# whether triton.jit decorates into its CPU interpreter in this process: TRITON_INTERPRET=1 when this module was
# imported, i.e. before the kernel modules that import it decorated their kernels
INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def triton_problem(device: torch.device) -> str | None:
    """None when this process can run the Triton kernels on tensors of `device`, else why not (one line)."""
    if triton is None:
        return (f"triton does not import ({TRITON_IMPORT_ERROR}); it comes with torch's CUDA builds, or "
                "`pip install -c requirements/cpu-constraints.txt triton==3.7.1` for the CPU interpreter")
    device = torch.device(device)
    if INTERPRETED:
        if device.type != "cpu":
            return f"TRITON_INTERPRET=1 runs the kernels on CPU tensors only; these are on {device}"
        return None
    if device.type != "cuda":
        return (f"the Triton kernels need CUDA tensors; these are on {device} (the CPU runs them only in "
                "Triton's interpreter: TRITON_INTERPRET=1 before moe.triton_* is imported)")
    return None


def require_triton(choice: str, device: torch.device) -> None:
    """Raise ImplementationError naming `choice` (e.g. "expert weight-gradient accumulation 'triton'") when
    the Triton kernels cannot run on `device` here."""
    problem = triton_problem(device)
    if problem is not None:
        raise ImplementationError(f"{choice} cannot run here: {problem}")
