"""Every CUDA-only torch call, checked on the CPU against two torches: the installed one and the GPU host's
(torch 2.11.0+cu130, whose signatures tools/torch_signatures.py read from its wheel into
tests/assets/gpu_host_torch_signatures.json).

Each API in moe.cuda_calls.APIS has a driver here that runs the project code which builds the call, on the CPU,
past its CUDA test: with tensors made under torch's FakeTensorMode with device="cuda" (they report is_cuda, and
most ops run on them from their meta kernels), or with `use_cuda()` made true. The call is intercepted in
moe.cuda_calls, its real positional and keyword arguments bound to both signatures (inspect.Signature.bind: an
unknown keyword, a missing argument, one too many all fail as the call would), and then either made (where it
runs on fake tensors or the CPU) or answered by a stand-in. A new API in the registry without a driver fails
here, and so does a call into one of these APIs anywhere but moe/cuda_calls.py.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import types
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe import cuda_calls
from multiprocess import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "assets" / "gpu_host_torch_signatures.json").read_text())
BF16_CUDA = dict(dtype=torch.bfloat16, device="cuda")


def fake_cuda():
    """FakeTensorMode in which real CPU tensors may mix with fake ones (modules built on the CPU)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class ContractChecker:
    """An interceptor for moe.cuda_calls: binds each call to one torch's signatures (`record`: a file of
    tools/torch_signatures.py; None: the installed torch), remembers what it saw, and runs the call or answers
    with the API's stand-in."""

    def __init__(self, record: dict | None = None, stand_ins: dict | None = None):
        self.record = record
        self.torch = torch.__version__ if record is None else record["torch"]
        if stand_ins is None:
            stand_ins = STAND_INS if record is None else {**STAND_INS, **RECORDED_TORCH_STAND_INS}
        self.stand_ins = stand_ins
        self.calls: list = []

    def __call__(self, api_name, fn, args, kwargs):
        if self.record is None:
            overloads = cuda_calls.installed_signatures(api_name)
        else:
            overloads = self.record["apis"][api_name]["overloads"]
        self.calls.append({"api": api_name, "kwargs": sorted(kwargs), "torch": self.torch,
                           "error": cuda_calls.binding_error(overloads, args, kwargs)})
        stand_in = self.stand_ins.get(api_name)
        return cuda_calls.CALL_THROUGH if stand_in is None else stand_in(fn, args, kwargs)


def violations(calls) -> list:
    return [f"{c['api']}(keywords {c['kwargs']}) against torch {c['torch']}: {c['error']}" for c in calls if c["error"]]


def checking(record: dict | None):
    """(detection context, checker): the wrappers build their calls as on `record`'s torch (None: the installed
    one), and the checker binds them to that torch's signatures."""
    checker = ContractChecker(record)
    detection = contextlib.nullcontext() if record is None else cuda_calls.detecting_against(record)
    return detection, checker


# What answers a call that cannot run here (no CUDA runtime; `out=` of fake tensors); None: the real call runs.
STAND_INS = {
    "torch.addmm": lambda fn, args, kwargs: kwargs["out"],
    "torch.cuda.get_rng_state": lambda fn, args, kwargs: torch.zeros(16, dtype=torch.uint8),
    "torch.cuda.set_rng_state": lambda fn, args, kwargs: None,
    "torch.cuda.current_device": lambda fn, args, kwargs: 0,
    "torch.cuda.set_device": lambda fn, args, kwargs: None,
    "torch.cuda.ipc_collect": lambda fn, args, kwargs: None,
    "torch.cuda.reset_peak_memory_stats": lambda fn, args, kwargs: None,
    "torch.cuda.max_memory_reserved": lambda fn, args, kwargs: 0,
    "torch.nn.Module.cuda": lambda fn, args, kwargs: fn.__self__,
}
# ... and, checking against a recorded torch, a call the installed torch would refuse for its own reasons (2.13's
# varlen_attn checks the head counts that 2.11 leaves to the kernel): the output's shape, as the kernel gives it
RECORDED_TORCH_STAND_INS = {
    "torch.nn.attention.varlen.varlen_attn": lambda fn, args, kwargs: torch.empty_like(args[0]),
}


# ---- drivers: the project code that builds each call, taken past its CUDA test on the CPU ----

LENGTHS = [5, 1, 7, 3]


def _packed_attention_module(heads=4, groups=2, dim=8):
    from megatron.core.transformer.enums import AttnMaskType

    from moe.architecture import Qwen3MoeArchitecture, transformer_config
    from moe.attention import SDPACoreAttention

    arch = Qwen3MoeArchitecture(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=heads,
                                num_key_value_heads=groups, head_dim=dim, moe_intermediate_size=16, num_experts=2,
                                num_experts_per_tok=2)
    tp_of_one = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    return SDPACoreAttention(transformer_config(arch), 1, AttnMaskType.causal, "self", pg_collection=tp_of_one)


def drive_varlen_attn():
    """SDPACoreAttention on a packed bf16 stream on "cuda": the varlen flash branch (GQA: 4 query, 2 kv heads)."""
    from moe.model import PackedSequences

    module = _packed_attention_module()
    total = sum(LENGTHS)
    with fake_cuda():
        params = PackedSequences.from_lengths(LENGTHS, device="cuda").megatron_params()
        q = torch.randn(total, 4, 8, **BF16_CUDA)
        k, v = torch.randn(total, 2, 8, **BF16_CUDA), torch.randn(total, 2, 8, **BF16_CUDA)
        out = module(q, k, v, None, packed_seq_params=params)
        assert out.shape == (total, 32) and out.is_cuda


def drive_addmm():
    """The fused log-prob's weight gradient into a float32 accumulator with bf16 operands (the probe said yes)."""
    import megagspo.kernels as K

    key = ("cuda", torch.bfloat16)
    before = K._ADDMM_OUT_DTYPE.get(key)
    K._ADDMM_OUT_DTYPE[key] = True
    try:
        with fake_cuda():
            acc = torch.zeros(24, 16, dtype=torch.float32, device="cuda")
            K._add_weight_grad(acc, torch.randn(8, 24, **BF16_CUDA), torch.randn(8, 16, **BF16_CUDA))
    finally:
        K._ADDMM_OUT_DTYPE.pop(key) if before is None else K._ADDMM_OUT_DTYPE.__setitem__(key, before)


def drive_grouped_mm():
    """The grouped experts' forward GEMM on bf16 "cuda" tokens (3 experts, rows 0 / 5 / 11)."""
    from moe.experts import GroupedLinear

    with fake_cuda():
        x_TK = torch.randn(16, 16, **BF16_CUDA)
        weights = [torch.randn(32, 16, **BF16_CUDA) for _ in range(3)]
        offs_E = torch.tensor([0, 5, 16], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            y_TN = GroupedLinear.apply(x_TK, offs_E, None, *weights)
        assert y_TN.shape == (16, 32)


def _adamw_body(rank, world_size, record):
    """build_optimizer(fused=True) as on CUDA, in its own process (Megatron's parallel state); the CPU has
    torch's fused AdamW too, so the call is made."""
    from moe.architecture import Qwen3MoeArchitecture
    from moe.model import build_model
    from moe.optimizer import OptimizerSettings, build_optimizer, wrap_data_parallel
    from moe.parallel import ParallelLayout, setup_process_groups

    layout = setup_process_groups(ParallelLayout(), 0).layout
    arch = Qwen3MoeArchitecture(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=2,
                                num_experts_per_tok=2, max_position_embeddings=16)
    detection, checker = checking(record)
    with detection, cuda_calls.intercept(checker):
        build_optimizer(wrap_data_parallel(build_model(arch, layout, use_transformer_engine=False)),
                        OptimizerSettings(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip_grad=1.0),
                        fused=True)
    return checker.calls


def drive_cuda_rng(monkeypatch):
    """A checkpoint of a CUDA run saves and restores the CUDA generator."""
    from megagspo.checkpoint import state

    monkeypatch.setattr(state, "use_cuda", lambda: True)
    gen = torch.Generator().manual_seed(0)
    captured = state.capture_rng(gen)
    tensors = {f"rank0/{k}": v for k, v in captured.items() if torch.is_tensor(v)}
    meta = {k: v for k, v in captured.items() if not torch.is_tensor(v)}
    state.restore_rng(tensors, meta, 0, gen)


def drive_cuda_device(monkeypatch):
    """A process on a GPU host: its model device, its GPU before NCCL starts, the model moved there, the device
    of NCCL collectives."""
    import moe.collective
    import moe.device
    import moe.model
    import moe.parallel

    monkeypatch.delenv("MEGAGSPO_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert moe.device.model_device() == torch.device("cuda", 0)
    started = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: started.append(backend))
    monkeypatch.setenv("RANK", "0")
    moe.parallel.init_distributed()
    assert started == ["nccl"]
    module = torch.nn.Linear(2, 2)
    assert moe.model.place_on_gpu(module) is module
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    assert moe.collective.collective_device() == torch.device("cuda", 0)


def drive_ipc_collect():
    """The SGLang tensor codec frees the IPC blocks the servers closed."""
    from megagspo.rollout.sglang import SGLangIpcCodec

    object.__new__(SGLangIpcCodec).release()


def drive_peak_memory():
    """The memory/ metrics of a CUDA process: a step's window reset, then its peak read."""
    from megagspo.rl.peak_memory import PeakMemory

    memory = PeakMemory(torch.device("cuda", 0))
    memory.start()
    memory.peak_gib()


def _run_driver(api_name, monkeypatch, record: dict | None) -> list:
    driver = DRIVERS[api_name]
    if driver is _adamw_body:
        return run_distributed(_adamw_body, world_size=1, args=(record,), timeout_s=180)[0]
    detection, checker = checking(record)
    with detection, cuda_calls.intercept(checker):
        if "monkeypatch" in driver.__code__.co_varnames[:driver.__code__.co_argcount]:
            driver(monkeypatch)
        else:
            driver()
    return checker.calls


DRIVERS = {
    "torch.nn.attention.varlen.varlen_attn": drive_varlen_attn,
    "torch.addmm": drive_addmm,
    "torch.nn.functional.grouped_mm": drive_grouped_mm,
    "torch.optim.AdamW": _adamw_body,
    "torch.cuda.get_rng_state": drive_cuda_rng,
    "torch.cuda.set_rng_state": drive_cuda_rng,
    "torch.cuda.current_device": drive_cuda_device,
    "torch.cuda.set_device": drive_cuda_device,
    "torch.nn.Module.cuda": drive_cuda_device,
    "torch.cuda.ipc_collect": drive_ipc_collect,
    "torch.cuda.reset_peak_memory_stats": drive_peak_memory,
    "torch.cuda.max_memory_reserved": drive_peak_memory,
}


def test_every_registered_api_has_a_driver_and_a_recorded_signature():
    assert set(DRIVERS) == set(cuda_calls.APIS), "each CUDA-only API needs a driver in this file"
    assert set(RECORDED["apis"]) == set(cuda_calls.APIS), (
        "tests/assets/gpu_host_torch_signatures.json is out of date: rerun tools/torch_signatures.py (its docstring)")
    assert RECORDED["torch"].startswith("2.11.0"), RECORDED["torch"]
    for name, api in cuda_calls.APIS.items():
        assert RECORDED["apis"][name]["source"] == api.source, name


@pytest.mark.parametrize("torch_of", ["installed", "gpu_host"])
@pytest.mark.parametrize("api_name", sorted(cuda_calls.APIS))
def test_cuda_only_call_binds_to_installed_and_gpu_host_torch(api_name, torch_of, monkeypatch):
    """The call as the code builds it for that torch (feature detection included) binds to its signature."""
    calls = _run_driver(api_name, monkeypatch, None if torch_of == "installed" else RECORDED)
    reached = [c for c in calls if c["api"] == api_name]
    assert reached, f"the driver of {api_name} never reached the call (the code path changed?)"
    assert not violations(reached), "\n".join(violations(reached))


def test_planted_enable_gqa_fails_against_torch_2_11(monkeypatch):
    """Today's bug, planted: the packed attention passes `enable_gqa=` whatever the torch, as it did at 14e93b1.
    The GPU host's 2.11 does not take it: the contract names the keyword."""
    monkeypatch.setattr(cuda_calls, "takes_keyword", lambda api_name, keyword: True)
    calls = _run_driver("torch.nn.attention.varlen.varlen_attn", monkeypatch, RECORDED)
    errors = violations(calls)
    assert calls and len(errors) == len(calls), calls
    assert all("torch 2.11.0" in e and "unexpected keyword argument 'enable_gqa'" in e for e in errors), errors


def test_planted_unknown_keyword_fails_for_every_api():
    """Any keyword neither torch knows is refused for every registered API, by both records."""
    for name in cuda_calls.APIS:
        overloads = RECORDED["apis"][name]["overloads"]
        if any(p["kind"] == "VAR_KEYWORD" for params in overloads for p in params):
            continue  # a **kwargs API takes any keyword: binding cannot judge it
        assert cuda_calls.binding_error(overloads, (), {"no_such_keyword_in_torch": 1}), name


def test_varlen_grouped_heads_follow_the_signature():
    """2.13 takes enable_gqa (passed); 2.11 does not (grouped k / v passed without it)."""
    cuda_calls.varlen_gqa_mode.cache_clear()
    takes = cuda_calls.takes_keyword("torch.nn.attention.varlen.varlen_attn", "enable_gqa")
    assert cuda_calls.varlen_gqa_mode() == ("kwarg" if takes else "grouped")
    with cuda_calls.detecting_against(RECORDED):
        assert cuda_calls.varlen_gqa_mode() == "grouped"
    assert cuda_calls.varlen_gqa_mode() == ("kwarg" if takes else "grouped")
    recorded = RECORDED["apis"]["torch.nn.attention.varlen.varlen_attn"]["overloads"]
    assert not any(p["name"] == "enable_gqa" for params in recorded for p in params)


@pytest.mark.parametrize("mode", ["grouped", "expand"])
def test_varlen_call_without_gqa_keyword_binds_to_torch_2_11(mode):
    """The two forms that need no enable_gqa: k / v passed with G heads, or expanded to N heads."""
    checker = ContractChecker(RECORDED)
    with cuda_calls.intercept(checker), fake_cuda():
        q = torch.randn(16, 4, 8, **BF16_CUDA)
        k = torch.randn(16, 2, 8, **BF16_CUDA)
        cu = torch.tensor([0, 9, 16], dtype=torch.int32, device="cuda")
        out = cuda_calls.varlen_attn(q, k, k, cu, 9, scale=0.3, gqa_mode=mode)
    assert out.shape == (16, 4, 8)
    assert not violations(checker.calls), violations(checker.calls)
    assert checker.calls[0]["kwargs"] == ["scale", "window_size"]


def test_varlen_refuses_bad_head_counts_and_modes():
    q, k = torch.zeros(4, 6, 8), torch.zeros(4, 4, 8)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="not a multiple"):
        cuda_calls.varlen_attn(q, k, k, cu, 4, scale=1.0, gqa_mode="expand")
    with pytest.raises(ValueError, match="gqa_mode 'wrong'"):
        cuda_calls.varlen_attn(q, q, q, cu, 4, scale=1.0, gqa_mode="wrong")


def test_signature_records_match_what_the_tool_reads_from_the_installed_torch():
    """tools/torch_signatures.py on the installed torch reproduces the installed signatures the checker uses."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_signatures", ROOT / "tools" / "torch_signatures.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    record = tool.record(os.path.dirname(torch.__file__), "test")
    assert record["torch"] == torch.__version__
    for name in cuda_calls.APIS:
        assert record["apis"][name]["overloads"] == cuda_calls.installed_signatures(name)


# ---- the one place: no call of these APIs outside moe/cuda_calls.py ----

# torch.cuda functions that run on any host (they answer "no CUDA here" on the CPU) and are not in the registry
HOST_SAFE_CUDA_FUNCTIONS = {"is_available"}
# modules allowed to name torch.cuda APIs without calling them for the model: the CPU shim replaces them
REGISTRY_EXEMPT = {"moe/cuda_calls.py", "moe/cpu_shim.py"}


def direct_cuda_only_calls(path: Path, source: str) -> list:
    """Calls in `source` of a registered API, or of any torch.cuda function, made other than through
    moe.cuda_calls: [(line, what)]."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        keywords = {k.arg for k in node.keywords}
        if func.startswith("torch.cuda.") and func.split(".")[-1] not in HOST_SAFE_CUDA_FUNCTIONS:
            found.append((node.lineno, func))
        elif func.endswith("varlen_attn") and not func.startswith("cuda_calls."):
            found.append((node.lineno, func))
        elif func.endswith("grouped_mm") and not func.startswith("cuda_calls."):
            found.append((node.lineno, func))
        elif func.endswith("addmm") and "out_dtype" in keywords:
            found.append((node.lineno, f"{func}(out_dtype=...)"))
        elif "fused" in keywords and "AdamW" in func:
            found.append((node.lineno, f"{func}(fused=...)"))
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and func != "cuda_calls.cuda":
            found.append((node.lineno, f"{func}()"))
    return found


def project_sources():
    for folder in ("megagspo", "moe"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_cuda_only_apis_are_called_only_through_the_registry():
    offenders = [f"{rel}:{line}: {what}" for rel, source in project_sources() if rel not in REGISTRY_EXEMPT
                 for line, what in direct_cuda_only_calls(Path(rel), source)]
    assert not offenders, "call these through moe.cuda_calls (and register new ones in APIS):\n" + "\n".join(offenders)


def test_registry_lint_catches_planted_direct_calls():
    planted = ("import torch\nfrom torch.nn.attention.varlen import varlen_attn\n"
               "def f(q, k, v, cu, acc, a, b, params, model):\n"
               "    torch.cuda.synchronize()\n"
               "    varlen_attn(q, k, v, cu, cu, 4, 4, enable_gqa=True)\n"
               "    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)\n"
               "    torch.optim.AdamW(params, fused=True)\n"
               "    model.cuda()\n"
               "    torch.nn.functional.grouped_mm(a, b, offs=cu)\n"
               "    return torch.cuda.is_available()\n")
    found = [what for _, what in direct_cuda_only_calls(Path("planted.py"), planted)]
    assert found == ["torch.cuda.synchronize", "varlen_attn", "torch.addmm(out_dtype=...)",
                     "torch.optim.AdamW(fused=...)", "model.cuda()", "torch.nn.functional.grouped_mm"]


def test_supported_torch_range_is_stated_once_and_checked():
    """requirements/torch-range.txt, moe.cuda_calls.SUPPORTED_TORCH, the recorded GPU-host torch and the CPU pin
    agree; a torch outside the range gets a one-line warning."""
    low, high = cuda_calls.SUPPORTED_TORCH
    spec = [line for line in (ROOT / "requirements" / "torch-range.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert spec == [f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"]
    pin = [line for line in (ROOT / "requirements" / "cpu-constraints.txt").read_text().splitlines()
           if line.startswith("torch==")]
    assert pin == [f"torch=={high[0]}.{high[1]}.0"]
    assert RECORDED["torch"].startswith(f"{low[0]}.{low[1]}.")
    assert cuda_calls.torch_version_problem("2.11.0+cu130") is None
    assert cuda_calls.torch_version_problem("2.13.0+cpu") is None
    assert "outside megagspo's supported range 2.11 to 2.13" in cuda_calls.torch_version_problem("2.9.1")
    assert cuda_calls.torch_version_problem("2.14.1") is not None
