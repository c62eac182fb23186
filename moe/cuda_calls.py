"""The one place the project calls torch APIs that only run on CUDA (or that the GPU host's older torch may spell
differently): each such call goes through a small wrapper here, and `APIS` lists them with the source of their
signature and the gpu-marked test that executes them.

Why: CI runs the CPU pin of torch (2.13) and never takes a CUDA-only branch, while the GPU host runs torch 2.11.
A keyword that only the newer torch knows (2.13's `varlen_attn(..., enable_gqa=)`) failed every CUDA trainer run
on 2026-11-28 and no CPU test could see it. With one choke point, a CPU test (tests/test_cuda_contract.py)
drives the project code that builds each call, intercepts the call with `intercept`, and binds its real
arguments to two signatures: the installed torch's and the GPU host's torch's, read from torch's own Python
sources and stubs by tools/torch_signatures.py and committed under tests/assets/.

Legend (docs/architecture.md): T tokens of a packed stream, N query heads, G key/value heads, D head dim, E experts.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator, List

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudaOnlyApi:
    """One torch API the project reaches only on CUDA. `source`: where torch defines it, as
    '<path under torch's package root>:<qualified name>' (a .py or a .pyi stub: builtins are read from
    torch/_C/*.pyi); a method's first parameter (self) is not part of the call. `gpu_test`: the gpu-marked test
    that executes the call on a GPU host. `why`: what keeps it off the CPU."""

    name: str
    source: str
    gpu_test: str
    why: str


APIS: dict = {a.name: a for a in (
    CudaOnlyApi("torch.nn.attention.varlen.varlen_attn", "nn/attention/varlen.py:varlen_attn",
                "tests/test_moe_packed_attention.py::test_packed_attention_on_cuda_is_varlen_flash_and_equals_padded",
                "flash attention kernels: CUDA with bf16 / fp16 only"),
    CudaOnlyApi("torch.addmm", "_C/_VariableFunctions.pyi:addmm",
                "tests/test_kernel_linear.py::test_weight_grad_buffer_megatron_protocol_on_cuda",
                "addmm with a float32 out_dtype for bf16 operands: CUDA's _addmm_dtype_out kernel, none on the CPU"),
    CudaOnlyApi("torch.nn.functional.grouped_mm", "nn/functional.py:grouped_mm",
                "tests/test_moe_grouped_experts.py::test_grouped_experts_equal_sequential_on_cuda",
                "runs on the CPU too (torch >= 2.13); on CUDA its bf16 kernel, whose signature torch 2.11 must take"),
    CudaOnlyApi("torch.optim.AdamW", "optim/adamw.py:AdamW.__init__",
                "tests/test_moe_optimizer_fused.py::test_cuda_build_optimizer_uses_fused_adamw_and_steps_like_torch_adamw",
                "fused=True: torch's fused AdamW kernel runs on CUDA parameters"),
    CudaOnlyApi("torch.cuda.get_rng_state", "cuda/random.py:get_rng_state",
                "tests/test_gpu_trainer.py::test_bf16_run_resumed_on_cuda_continues",
                "the CUDA generator's state, saved in checkpoints of CUDA runs"),
    CudaOnlyApi("torch.cuda.set_rng_state", "cuda/random.py:set_rng_state",
                "tests/test_gpu_trainer.py::test_bf16_run_resumed_on_cuda_continues",
                "the CUDA generator's state, restored on resume of a CUDA run"),
    CudaOnlyApi("torch.cuda.current_device", "cuda/__init__.py:current_device",
                "tests/test_gpu_trainer.py::test_tiny_recipe_trains_on_cuda",
                "this process's GPU (the CPU shim replaces it for Megatron on CUDA-less hosts)"),
    CudaOnlyApi("torch.cuda.set_device", "cuda/__init__.py:set_device",
                "tests/test_gpu_trainer.py::test_tiny_recipe_trains_on_cuda",
                "one GPU per process before NCCL binds a device"),
    CudaOnlyApi("torch.cuda.ipc_collect", "cuda/__init__.py:ipc_collect",
                "tests/test_sglang_engine.py::test_real_server_in_memory_weight_sync",
                "frees CUDA IPC blocks that the SGLang servers have closed"),
    CudaOnlyApi("torch.nn.Module.cuda", "nn/modules/module.py:Module.cuda",
                "tests/test_gpu_trainer.py::test_tiny_recipe_trains_on_cuda",
                "moves the Megatron model to this process's GPU"),
    CudaOnlyApi("torch.cuda.reset_peak_memory_stats", "cuda/memory.py:reset_peak_memory_stats",
                "tests/test_gpu_trainer.py::test_producer_with_partial_rollouts_and_r3_on_cuda",
                "the caching allocator's peak counters, reset where a memory/ metric's window starts"),
    CudaOnlyApi("torch.cuda.max_memory_reserved", "cuda/memory.py:max_memory_reserved",
                "tests/test_gpu_trainer.py::test_producer_with_partial_rollouts_and_r3_on_cuda",
                "the caching allocator's peak reserved bytes: the memory/ metrics of a CUDA process"),
)}

# The supported range (requirements/torch-range.txt): the GPU image's torch up to the CPU pin, both checked by CI
SUPPORTED_TORCH = ((2, 11), (2, 13))


def torch_version_problem(version: str | None = None) -> str | None:
    """None for a torch in SUPPORTED_TORCH, else one line saying why another may fail."""
    version = version or torch.__version__
    major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_TORCH
    if low <= major_minor <= high:
        return None
    return (f"torch {version} is outside megagspo's supported range {low[0]}.{low[1]} to {high[0]}.{high[1]} "
            f"(requirements/torch-range.txt): its CUDA-only calls are checked against those two versions only")


CALL_THROUGH = object()
"""What an interceptor returns to let the real call run."""

_INTERCEPTORS: List[Callable] = []


@contextlib.contextmanager
def intercept(handler: Callable) -> Iterator[None]:
    """Within the block, every call below goes first to `handler(api_name, fn, args, kwargs)` (fn: the torch
    callable it would run), innermost first: a
    return value other than CALL_THROUGH replaces the call's result (so a CPU test can reach a CUDA-only call
    and stand in for it); CALL_THROUGH lets the real call run. For tests: production never installs one."""
    _INTERCEPTORS.append(handler)
    try:
        yield
    finally:
        _INTERCEPTORS.remove(handler)


def _call(api_name: str, fn: Callable, *args, **kwargs):
    for handler in reversed(_INTERCEPTORS):
        result = handler(api_name, fn, args, kwargs)
        if result is not CALL_THROUGH:
            return result
    return fn(*args, **kwargs)


# ---- signatures read from torch's sources (no import of the API itself: builtins have no Python signature) ----

def read_signatures(torch_root: str, source: str) -> list:
    """The signatures of `source` ('<path>:<qualname>', see CudaOnlyApi) in the torch package at `torch_root`,
    read with ast: one entry per overload (stubs declare several), each a list of {name, kind, default}
    (kind as inspect.Parameter's names; default True where the parameter has one). A method's self is dropped."""
    path, qualname = source.split(":")
    file = os.path.join(torch_root, path)
    with open(file, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=file)
    *owners, name = qualname.split(".")
    scope = tree.body
    for owner in owners:
        classes = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner]
        if not classes:
            raise LookupError(f"{file}: no class {owner!r} (looking for {qualname})")
        scope = classes[0].body
    defs = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if not defs:
        raise LookupError(f"{file}: no function {qualname!r}")
    return [_params(d.args, drop_first=bool(owners) and not _is_static(d)) for d in defs]


def _is_static(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def _params(args: ast.arguments, drop_first: bool) -> list:
    positional = [(a, "POSITIONAL_ONLY") for a in args.posonlyargs] + [(a, "POSITIONAL_OR_KEYWORD") for a in args.args]
    with_default = set(range(len(positional) - len(args.defaults), len(positional)))
    out = [{"name": a.arg, "kind": kind, "default": i in with_default} for i, (a, kind) in enumerate(positional)]
    if drop_first:
        out = out[1:]
    if args.vararg is not None:
        out.append({"name": args.vararg.arg, "kind": "VAR_POSITIONAL", "default": False})
    out += [{"name": a.arg, "kind": "KEYWORD_ONLY", "default": d is not None}
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        out.append({"name": args.kwarg.arg, "kind": "VAR_KEYWORD", "default": False})
    return out


def as_signature(params: list) -> inspect.Signature:
    """An inspect.Signature from `read_signatures`' records (defaults as a placeholder: only binding matters)."""
    return inspect.Signature([inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]),
                                                default=None if p["default"] else inspect.Parameter.empty)
                              for p in params])


def binding_error(overloads: list, args: tuple, kwargs: dict):
    """None when (args, kwargs) bind to one of `overloads` (records of `read_signatures`), else the TypeError
    message of the first overload (what a call would raise)."""
    first = None
    for params in overloads:
        try:
            as_signature(params).bind(*args, **kwargs)
            return None
        except TypeError as exc:
            first = first or str(exc)
    return first


@functools.lru_cache(maxsize=None)
def installed_signatures(api_name: str) -> list:
    """`read_signatures` of `api_name` in the torch this process imported (read once; callers do not modify it)."""
    return read_signatures(os.path.dirname(torch.__file__), APIS[api_name].source)


_DETECT_AGAINST: list = []  # a recorded torch's {"apis": ...} while `detecting_against` runs (tests only)


def overloads_for_detection(api_name: str) -> list:
    """The signatures feature detection reads: the installed torch's, or the record `detecting_against` set."""
    if _DETECT_AGAINST:
        return _DETECT_AGAINST[-1]["apis"][api_name]["overloads"]
    return installed_signatures(api_name)


@contextlib.contextmanager
def detecting_against(record: dict) -> Iterator[None]:
    """Within the block, the wrappers build their calls as they would on the torch of `record` (a file of
    tools/torch_signatures.py): so a CPU test can check the call the GPU host's torch will actually receive."""
    _DETECT_AGAINST.append(record)
    varlen_gqa_mode.cache_clear()
    try:
        yield
    finally:
        _DETECT_AGAINST.pop()
        varlen_gqa_mode.cache_clear()


def takes_keyword(api_name: str, keyword: str) -> bool:
    """Whether `api_name` accepts `keyword` (any overload) in the torch feature detection reads."""
    return any(p["name"] == keyword for params in overloads_for_detection(api_name) for p in params)


# ---- the wrappers: the project's only calls of the APIs above ----

VARLEN_GQA_MODES = ("kwarg", "grouped", "expand")


@functools.lru_cache(maxsize=None)
def varlen_gqa_mode() -> str:
    """How grouped-query heads reach torch's varlen flash attention, decided once from its signature:
    'kwarg' where varlen_attn takes `enable_gqa` (torch >= 2.13: it then only relaxes its own head-count check);
    'grouped' where it does not (torch 2.11: no check at all), passing k / v with their G heads as 2.13 does
    after its check, since both versions hand them to the same `aten._flash_attention_forward` /
    `_flash_attention_backward`, whose kernels take G dividing N. 'expand' (repeat each key/value head for its
    N / G query heads) is the slower equivalent, kept for A/B on a GPU host (tests/test_moe_packed_attention.py)."""
    mode = "kwarg" if takes_keyword("torch.nn.attention.varlen.varlen_attn", "enable_gqa") else "grouped"
    log.info("varlen flash attention: grouped-query heads passed as %r (torch %s)", mode, torch.__version__)
    return mode


def varlen_attn(q_TND: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor, cu_seqlens_N1: torch.Tensor,
                max_seqlen: int, *, scale: float, gqa_mode: str | None = None) -> torch.Tensor:
    """Causal variable-length flash attention over a packed stream (each sequence of cu_seqlens attends to
    itself only) -> [T, N, D]. `gqa_mode`: see `varlen_gqa_mode` (None: detected)."""
    from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn

    mode = gqa_mode or varlen_gqa_mode()
    if mode not in VARLEN_GQA_MODES:
        raise ValueError(f"varlen_attn: gqa_mode {mode!r}; expected one of {', '.join(VARLEN_GQA_MODES)}")
    heads, groups = q_TND.shape[1], k_TGD.shape[1]
    if heads % groups:
        raise ValueError(f"varlen_attn: {heads} query heads are not a multiple of {groups} key/value heads")
    cu_N1 = cu_seqlens_N1.to(torch.int32)
    kwargs = {"scale": scale, "window_size": (-1, 0)}  # window (-1, 0): causal
    if heads != groups:
        if mode == "kwarg":
            kwargs["enable_gqa"] = True
        elif mode == "expand":
            k_TGD = k_TGD.repeat_interleave(heads // groups, dim=1)
            v_TGD = v_TGD.repeat_interleave(heads // groups, dim=1)
    return _call("torch.nn.attention.varlen.varlen_attn", torch_varlen_attn,
                 q_TND, k_TGD, v_TGD, cu_N1, cu_N1, max_seqlen, max_seqlen, **kwargs)


def addmm_out_dtype(acc: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """acc += mat1 @ mat2 in ONE GEMM whose output (and accumulation) is acc's dtype while the operands stay
    low-precision: torch.addmm(..., out_dtype=, out=acc). CUDA only (callers probe for it)."""
    return _call("torch.addmm", torch.addmm, acc, mat1, mat2, out_dtype=acc.dtype, out=acc)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (one GEMM per group of rows / columns that `offs` ends); CPU and CUDA."""
    return _call("torch.nn.functional.grouped_mm", torch.nn.functional.grouped_mm, a, b, offs=offs)


def adamw(adamw_class: type, args: tuple, kwargs: dict, fused: bool) -> torch.optim.Optimizer:
    """`adamw_class(*args, **kwargs)` (torch.optim.AdamW or a subclass), with fused=True unless the caller set
    `fused` itself: torch's fused kernel on CUDA parameters."""
    if fused:
        kwargs = {**kwargs, "fused": kwargs.get("fused", True)}
    return _call("torch.optim.AdamW", adamw_class, *args, **kwargs)


def cuda_rng_state() -> torch.Tensor:
    """The current GPU's generator state (a checkpoint of a CUDA run keeps it)."""
    return _call("torch.cuda.get_rng_state", torch.cuda.get_rng_state)


def set_cuda_rng_state(state: torch.Tensor) -> None:
    _call("torch.cuda.set_rng_state", torch.cuda.set_rng_state, state)


def current_cuda_device() -> int:
    """This process's GPU index."""
    return _call("torch.cuda.current_device", torch.cuda.current_device)


def set_cuda_device(device) -> None:
    _call("torch.cuda.set_device", torch.cuda.set_device, device)


def cuda_ipc_collect() -> None:
    _call("torch.cuda.ipc_collect", torch.cuda.ipc_collect)


def module_to_cuda(module: torch.nn.Module, device) -> torch.nn.Module:
    return _call("torch.nn.Module.cuda", module.cuda, device)


def reset_peak_memory(device) -> None:
    """Restart the caching allocator's peak counters of `device` (a CUDA device)."""
    _call("torch.cuda.reset_peak_memory_stats", torch.cuda.reset_peak_memory_stats, device)


def max_memory_reserved(device) -> int:
    """The caching allocator's peak reserved bytes on `device` since its counters were last reset."""
    return _call("torch.cuda.max_memory_reserved", torch.cuda.max_memory_reserved, device)
