"""The Triton kernels of the grouped experts against their pure-torch references: the grouped weight-gradient
GEMM that accumulates into fp32 main_grad (moe.triton_wgrad, `expert_wgrad=triton`) and SwiGLU x routing
probability forward / backward (moe.triton_swiglu, `expert_activation=fused`).

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in the environment of a child
process before anything imports the kernel modules, since triton.jit reads it when it decorates; this pytest
process itself keeps the compiled kernels and checks the refusals). Measured: the interpreter's bf16 is wrong
(tl.dot on bf16 returns garbage, its casts to bf16 truncate instead of rounding to nearest), so the CPU runs fp32
and fp16; bf16 runs in the gpu-marked tests, with the whole GroupedGemmExperts under Megatron DDP.

Tolerances (TOLERANCES, dtype of the kernel's inputs -> (atol scale, rtol); |got - expected| <= atol scale x
max|expected| + rtol x |expected|, expected = the same computation by torch in the same dtype):
  wgrad    both accumulate in fp32 (products of 16-bit inputs are exact in fp32): only the summation order
           differs, so every dtype gets fp32's (2e-6, 1e-5) against a float64 sum
  swiglu   each 16-bit rounding step (silu, the up product, the probability product) may land one ulp apart when
           exp / division differ in the last fp32 bit (Triton's fast exp on a GPU): 2 ulps of the dtype
Inputs are fresh random draws per run (the seed is in every message), shapes odd and small: 4 experts, one of
them empty and one with a single row, widths 40 and 24 (multiples of 16 bytes), 37 / 1 / 0 routed rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from devices import cuda_env, megatron_groups
from helpers import REPO, assert_close_scaled, tiny_arch
from multiprocess import cpu_pinned_env, run_distributed

# not moe.experts here: it loads Megatron-Core (seconds), which the kernels' child process does not need
from moe import triton_support
from moe.implementation import ImplementationError, ModelImplementation
from moe.triton_swiglu import (SwigluProbs, SwigluTiles, swiglu_probs_backward, swiglu_probs_forward,
                               swiglu_probs_reference, uses_triton)
from moe.triton_wgrad import WgradTiles, grouped_wgrad_accumulate

TOLERANCES = {  # dtype -> (atol scale, rtol); see the module docstring
    "wgrad": {torch.float32: (2e-6, 1e-5), torch.float16: (2e-6, 1e-5), torch.bfloat16: (2e-6, 1e-5)},
    "swiglu": {torch.float32: (1e-6, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)},
}
INTERPRETER_ENV = {"TRITON_INTERPRET": "1"}
COUNTS = [9, 0, 23, 1]  # rows per expert: an empty one, a single row; T = 33
N, K, I = 40, 24, 24
# small tiles: several tiles per expert, several row steps, ragged edges; the defaults: one masked tile
SMALL_WGRAD, SMALL_SWIGLU = WgradTiles(16, 16, 16, 4, 2), SwigluTiles(8, 16, 4)
# the GPU also runs a shape the default 128 x 128 tiles cover with several tiles and row steps
GPU_COUNTS, GPU_N, GPU_K, GPU_I = [0, 300, 1, 77, 0, 129, 64, 5], 384, 256, 768
MODULE_COUNTS = [0, 5, 3, 0, 1, 7]  # the whole experts module: 6 experts, two of them empty


def _interpreter_problem() -> str | None:
    if triton_support.triton is None:
        return f"triton does not import: {triton_support.TRITON_IMPORT_ERROR}"
    major_minor = tuple(int(x) for x in triton_support.triton.__version__.split(".")[:2])
    if major_minor < (3, 7):  # moe.triton_support: 3.6's interpreter fails with numpy 2.4 (runtime loop bounds)
        return f"triton {triton_support.triton.__version__}'s interpreter: the CPU tests need triton >= 3.7"
    return None


needs_interpreter = pytest.mark.skipif(_interpreter_problem() is not None, reason=str(_interpreter_problem()))


# ---------------------------------------------------------------------------------------------- child bodies

def _wgrad_body(rank, world_size, seed, device, dtypes, counts, n, k):
    """Every wgrad case on `device`: (before, after) of an [E, N, K] view with a gap between experts and of a
    list of separate main_grads (a pointer table), each accumulated twice; the inputs come back too."""
    gen = torch.Generator().manual_seed(seed)
    offs_E = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    e, t = len(counts), sum(counts)
    out = {}
    for dtype in dtypes:
        dy_TN = torch.randn(t, n, generator=gen).to(device, dtype)
        x_TK = torch.randn(t, k, generator=gen).to(device, dtype)
        out[("inputs", dtype)] = (dy_TN, x_TK)
        for name, tiles in (("default", None), ("small", SMALL_WGRAD)):
            stride = n * k + 16  # DDP's padding between two experts: the gap must stay untouched
            buf = torch.randn(e * stride, generator=gen).to(device)
            before = buf.clone()
            main_ENK = buf.as_strided((e, n, k), (stride, k, 1))
            mains = [torch.randn(n, k, generator=gen).to(device) for _ in counts]
            table_before = [m.clone() for m in mains]
            for _ in range(2):
                grouped_wgrad_accumulate(main_ENK, dy_TN, x_TK, offs_E, tiles)
                grouped_wgrad_accumulate(mains, dy_TN, x_TK, offs_E, tiles)
            out[("view", dtype, name)] = (before, buf.clone(), stride)
            out[("table", dtype, name)] = (table_before, mains)
        empty = torch.randn(e, n, k, generator=gen).to(device)
        kept = empty.clone()
        grouped_wgrad_accumulate(empty, dy_TN[:0], x_TK[:0], torch.zeros_like(offs_E))
        out[("no rows", dtype)] = torch.equal(empty, kept)
    # main_grads the kernel must refuse: experts overlapping in a view, one tensor twice in the table (two
    # programs adding into the same elements at once), a view on another device
    shared = torch.zeros(n, k, device=device)
    refused = {"overlapping experts": torch.zeros(e * 8 + n * k, device=device).as_strided((e, n, k), (8, k, 1)),
               "one tensor twice": [shared] * e, "another device": torch.zeros(e, n, k, device="meta")}
    out["refused"] = {}
    for what, mains in refused.items():
        try:
            grouped_wgrad_accumulate(mains, dy_TN, x_TK, offs_E)
            out["refused"][what] = None
        except ValueError as exc:
            out["refused"][what] = str(exc)
    out["refused untouched"] = bool((shared == 0).all())
    return out


def _swiglu_body(rank, world_size, seed, device, dtypes, i):
    """The kernels and SwigluProbs (use_triton) on fresh inputs, with the unfused torch path's values and
    gradients in the same dtype, for fc1 dtypes x probs in fp32 (the router's) or in fc1's dtype."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for dtype in dtypes:
        for probs_dtype in dict.fromkeys((torch.float32, dtype)):
            for t, name, tiles in ((37, "default", SwigluTiles()), (37, "small", SMALL_SWIGLU),
                                   (1, "default", SwigluTiles()), (0, "default", SwigluTiles())):
                fc1_TF = (3 * torch.randn(t, 2 * i, generator=gen)).to(device, dtype)
                probs_T = torch.rand(t, generator=gen).to(device, probs_dtype)
                dout_TI = torch.randn(t, i, generator=gen).to(device, dtype)
                kernel = (swiglu_probs_forward(fc1_TF, probs_T, tiles),
                          *swiglu_probs_backward(dout_TI, fc1_TF, probs_T, tiles))
                f, p = fc1_TF.clone().requires_grad_(True), probs_T.clone().requires_grad_(True)
                function_out = SwigluProbs.apply(f, p, True)
                function_out.backward(dout_TI)
                f2, p2 = fc1_TF.clone().requires_grad_(True), probs_T.clone().requires_grad_(True)
                torch_out = swiglu_probs_reference(f2, p2)  # the unfused ops under autograd
                torch_out.backward(dout_TI)
                out[(dtype, probs_dtype, t, name)] = {
                    "kernel": kernel, "function": (function_out.detach(), f.grad, p.grad),
                    "torch": (torch_out.detach(), f2.grad, p2.grad)}
    return out


def _kernels_body(rank, world_size, seed, device, dtypes, counts, n, k, i):
    """Both kernels' cases in one process (one start-up and import of the interpreter's child)."""
    return (_wgrad_body(rank, world_size, seed, device, dtypes, counts, n, k),
            _swiglu_body(rank, world_size, seed, device, dtypes, i))


def _module_body(rank, world_size, seed, dtypes, arch, counts):
    """GroupedGemmExperts under Megatron DDP (main_grad the [E, N, K] view of its buffer), add / torch against
    triton / fused on the same weights and tokens: output, token and probability gradients, and every expert's
    main_grad after two micro-batches. bf16 also gets an fp32 add / torch run on the bf16-rounded weights."""
    import moe.triton_swiglu as swiglu_module
    import moe.triton_wgrad as wgrad_module
    from moe.model import build_model
    from moe.optimizer import wrap_data_parallel
    from moe.sharding import load_full_state_dict

    # every call of the kernels' launchers counted (the wgrad by its main_grad operand): `fused` / `triton` must
    # run them, not the torch reference or grouped_mm, and `add` / `torch` must not
    launches = {}

    def counted(module, name, kind=None):
        original = getattr(module, name)

        def launcher(*args, **kwargs):
            key = name if kind is None else kind(args)
            launches[key] = launches.get(key, 0) + 1
            return original(*args, **kwargs)
        setattr(module, name, launcher)

    counted(wgrad_module, "grouped_wgrad_accumulate",
            lambda args: "wgrad into the [E, N, K] view" if torch.is_tensor(args[0]) else "wgrad into a table")
    counted(swiglu_module, "swiglu_probs_forward")
    counted(swiglu_module, "swiglu_probs_backward")
    megatron_groups(seed)
    gen = torch.Generator().manual_seed(seed)
    runs = [(dtype, impl) for dtype in dtypes for impl in (("add", "torch"), ("triton", "fused"))]
    if torch.bfloat16 in dtypes:
        runs.append(("reference", ("add", "torch")))
    full = None
    t = sum(counts)
    # bf16-representable tokens: the fp32 reference of the bf16 runs reads the same values
    hidden_TH = torch.randn(t, arch.hidden_size, generator=gen).bfloat16().float()
    probs_T = torch.rand(t, generator=gen)
    grad_TH = torch.randn(t, arch.hidden_size, generator=gen)
    out = {}
    for dtype, (wgrad, activation) in runs:
        model = build_model(arch, params_dtype=torch.float32 if dtype == "reference" else dtype,
                            use_transformer_engine=False, implementation=ModelImplementation(
                                experts="grouped", expert_wgrad=wgrad, expert_activation=activation))
        if full is None:
            full = {n: p.detach().clone().bfloat16() for n, p in model.named_parameters()}
        load_full_state_dict(model, {n: w.to(next(model.parameters()).dtype) for n, w in full.items()})
        ddp = wrap_data_parallel(model)
        experts = model.decoder.layers[0].mlp.experts
        device = next(experts.parameters()).device
        ddp.zero_grad_buffer()
        launches.clear()
        results = []
        for _ in range(2):  # the second micro-batch accumulates into the same main_grad
            h = hidden_TH.to(device, next(experts.parameters()).dtype).requires_grad_(True)
            p = probs_T.to(device).requires_grad_(True)
            out_TH, _ = experts(h, torch.tensor(counts), p)
            (out_TH.float() * grad_TH.to(device)).sum().backward()
            results.append((out_TH.detach(), h.grad, p.grad))
        mains = {n: prm.main_grad.clone() for n, prm in experts.named_parameters()}
        out[(dtype, wgrad, activation)] = (results, mains, experts.activation, experts.wgrad_accumulation)
        out[("launches", dtype, wgrad, activation)] = dict(launches)
    return out


# ---------------------------------------------------------------------------------------------- checks

def _close(kind, dtype, got, expected, what):
    if expected.numel() == 0:  # T = 0: nothing to compare but the shape
        assert got.shape == expected.shape, what
        return
    atol_scale, rtol = TOLERANCES[kind][dtype]
    assert_close_scaled(got.double(), expected.double(), what, rtol=rtol, atol_scale=atol_scale)


def _check_wgrad(seed, out, dtype, counts, n, k):
    dy_TN, x_TK = (a.double() for a in out[("inputs", dtype)])
    ends = torch.tensor(counts).cumsum(0).tolist()
    dw_ENK = torch.stack([dy_TN[end - c:end].t() @ x_TK[end - c:end] for c, end in zip(counts, ends)])
    for name in ("default", "small"):
        before, after, stride = out[("view", dtype, name)]
        e = len(counts)
        view = lambda buf: buf.as_strided((e, n, k), (stride, k, 1))  # noqa: E731
        _close("wgrad", dtype, view(after), view(before).double() + 2 * dw_ENK, f"seed {seed} {dtype} {name} view")
        gap = torch.ones_like(before, dtype=torch.bool)
        gap.as_strided((e, n, k), (stride, k, 1)).fill_(False)
        assert torch.equal(after[gap], before[gap]), f"seed {seed}: the padding between experts was written"
        table_before, table_after = out[("table", dtype, name)]
        for ex, count in enumerate(counts):
            _close("wgrad", dtype, table_after[ex], table_before[ex].double() + 2 * dw_ENK[ex],
                   f"seed {seed} {dtype} {name} table expert {ex}")
            if count == 0:  # an empty expert's main_grad is left exactly as it was
                assert torch.equal(view(after)[ex], view(before)[ex]) and torch.equal(table_after[ex],
                                                                                       table_before[ex])
    assert out[("no rows", dtype)]
    messages = {"overlapping experts": "experts or rows overlap", "one tensor twice": "one tensor more than once",
                "another device": "contiguous rows on"}
    for what, expected in messages.items():
        assert out["refused"][what] and expected in out["refused"][what], (what, out["refused"][what])
    assert out["refused untouched"]


def _check_swiglu(seed, out, dtypes):
    assert out, "no swiglu case ran"
    for (dtype, probs_dtype, t, name), case in out.items():
        if dtype not in dtypes:
            continue
        where = f"seed {seed} fc1 {dtype} probs {probs_dtype} T={t} tiles {name}"
        for label, got, expected in zip(("out", "d fc1", "d probs"), case["kernel"], case["torch"]):
            assert got.dtype == expected.dtype and got.shape == expected.shape, (where, label)
            _close("swiglu", dtype, got, expected, f"{where} {label}")
        if name == "default":  # the autograd Function runs the same kernels (default tiles): the same bits
            for label, got, kernel in zip(("out", "d fc1", "d probs"), case["function"], case["kernel"]):
                assert torch.equal(got, kernel), f"{where} SwigluProbs {label}"


# ---------------------------------------------------------------------------------------------- CPU tests

@pytest.fixture(scope="module")
def interpreted_kernels():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    dtypes = (torch.float32, torch.float16)
    wgrad, swiglu = run_distributed(_kernels_body, world_size=1, args=(seed, "cpu", dtypes, COUNTS, N, K, I),
                                    env=INTERPRETER_ENV, timeout_s=300)[0]
    return seed, wgrad, swiglu


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_wgrad_kernel_accumulates_into_strided_view_and_pointer_table(interpreted_kernels, dtype):
    seed, wgrad, _ = interpreted_kernels
    _check_wgrad(seed, wgrad, dtype, COUNTS, N, K)


@needs_interpreter
def test_swiglu_probs_kernels_equal_the_unfused_torch_path(interpreted_kernels):
    seed, _, swiglu = interpreted_kernels
    _check_swiglu(seed, swiglu, (torch.float32, torch.float16))


@needs_interpreter
def test_grouped_experts_triton_and_fused_equal_add_and_torch_under_ddp():
    """The whole experts module in Megatron DDP, fp32, in the interpreter: outputs, token / probability
    gradients and main_grad after two micro-batches, `triton` + `fused` against `add` + `torch`."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    arch = tiny_arch("moe", num_experts=len(MODULE_COUNTS), moe_intermediate_size=24)
    out = run_distributed(_module_body, world_size=1, args=(seed, (torch.float32,), arch, MODULE_COUNTS),
                          env=INTERPRETER_ENV, timeout_s=300)[0]
    _check_module(seed, out, torch.float32)


def _check_module(seed, out, dtype):
    ref_results, ref_mains, ref_act, _ = out[(dtype, "add", "torch")]
    results, mains, act, wgrad = out[(dtype, "triton", "fused")]
    assert (act, wgrad, ref_act) == ("fused", "triton", "torch")
    # two micro-batches: fc1 and fc2 weight gradients into DDP's buffer view, one fused forward and backward each
    launches = {impl: out[("launches", dtype, *impl)] for impl in (("triton", "fused"), ("add", "torch"))}
    assert launches == {("triton", "fused"): {"wgrad into the [E, N, K] view": 4, "swiglu_probs_forward": 2,
                                              "swiglu_probs_backward": 2},
                        ("add", "torch"): {}}, (seed, dtype, launches)
    if dtype == torch.float32:
        for step, (got, expected) in enumerate(zip(results, ref_results)):
            for label, g, e in zip(("output", "d tokens", "d probs"), got, expected):
                assert_close_scaled(g, e, f"seed {seed} step {step} {label}", rtol=1e-5, atol_scale=2e-6)
        for name, expected in ref_mains.items():
            assert_close_scaled(mains[name], expected, f"seed {seed} main_grad {name}", rtol=1e-5, atol_scale=2e-6)
    else:  # bf16: each path's error against fp32 math on the same bf16 weights; fused / triton within 2x add's
        _, fp32_mains, _, _ = out[("reference", "add", "torch")]
        fp32_results = out[("reference", "add", "torch")][0]
        pairs = [(f"step {s} {label}", g, e, r) for s in range(2)
                 for label, g, e, r in zip(("output", "d tokens", "d probs"), results[s], ref_results[s],
                                           fp32_results[s])]
        pairs += [(f"main_grad {n}", mains[n], ref_mains[n], fp32_mains[n]) for n in ref_mains]
        for what, got, add, ref in pairs:
            ulp = 2.0**-8 * float(ref.abs().max())
            got_err, add_err = (float((x.float() - ref.float()).abs().max()) for x in (got, add))
            assert got_err <= 2 * add_err + ulp, f"seed {seed} {what}: triton/fused {got_err:.3g}, add {add_err:.3g}"
    for name, main in mains.items():  # an empty expert's main_grad stays exactly zero
        e = int(name.split(".")[1])
        assert (main.abs().max() == 0) == (MODULE_COUNTS[e] == 0), (seed, name)


@needs_interpreter
def test_kernel_benchmark_runs_in_the_interpreter(tmp_path):
    """benchmarks/bench_expert_kernels.py (the GPU session's tile A/B) end to end at tiny shapes on the CPU."""
    out_json = tmp_path / "kernels.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_expert_kernels.py"), "--device", "cpu",
           "--experts", "3", "--hidden", "32", "--moe-ffn", "16", "--rows", "24", "--repeats", "1",
           "--tiles", "32,32,16,4,2;16,16,16,4,2", "--json", str(out_json)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_pinned_env(OMP_NUM_THREADS="1", **INTERPRETER_ENV),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    facts = json.loads(out_json.read_text())
    assert set(facts["wgrad"]) == {"fc1", "fc2"} and set(facts["swiglu"]) == {"torch", "fused"}
    assert len([k for k in facts["wgrad"]["fc1"] if k.startswith("triton")]) == 2
    assert facts["wgrad"]["fc1"]["add"]["ms"] > 0 and "swiglu x probs fused" in proc.stdout


def _compile_for_sm90(kernel, pointer_types: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Triton's ahead-of-time compile of `kernel` for sm_90 (its bundled ptxas; no GPU needed): pointers as
    given, every other argument i32, arguments and pointers 16-divisible as the JIT specialises them where they
    are (strides and widths at Qwen3-30B-A3B shapes, torch allocations)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    names = kernel.arg_names
    signature = {a: pointer_types.get(a, "constexpr" if a in constexprs else "i32") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a not in constexprs and a != "T"}
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton_support.triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                         options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.skipif(triton_support.triton is None,
                    reason=f"triton does not import: {triton_support.TRITON_IMPORT_ERROR}")
def test_kernels_compile_for_sm90_with_wgmma_and_pipelined_loads():
    """What the interpreter cannot show: the bf16 kernels compile for Hopper (also done with the GPU image's
    triton 3.6.0, 2026-11-29), the weight-gradient GEMM on wgmma with cp.async-pipelined operand loads and
    16-byte epilogue loads / stores of main_grad, through the [E, N, K] view and the pointer table alike."""
    from moe.triton_swiglu import DEFAULT_TILES as SWIGLU_TILES
    from moe.triton_swiglu import _swiglu_probs_bwd_kernel, _swiglu_probs_fwd_kernel
    from moe.triton_wgrad import DEFAULT_TILES, _grouped_wgrad_kernel

    tiles = DEFAULT_TILES
    for table in (False, True):
        ptx = _compile_for_sm90(
            _grouped_wgrad_kernel, {"dy_ptr": "*bf16", "x_ptr": "*bf16", "main_ptr": "*i64" if table else "*fp32",
                                    "offs_ptr": "*i32"},
            {"MAIN_IS_TABLE": table, "FP32_IEEE": False, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
             "BLOCK_T": tiles.block_t}, tiles.num_warps, tiles.num_stages).asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, f"table={table}: no wgmma / async copies"
        assert ptx.count("st.global.v4") >= 16, f"table={table}: main_grad not stored in 16-byte vectors"
    pointers = {"fc1_ptr": "*bf16", "probs_ptr": "*fp32", "out_ptr": "*bf16", "dout_ptr": "*bf16",
                "dfc1_ptr": "*bf16", "dprobs_ptr": "*fp32"}
    for kernel in (_swiglu_probs_fwd_kernel, _swiglu_probs_bwd_kernel):
        ptx = _compile_for_sm90(kernel, pointers, {"BLOCK_T": SWIGLU_TILES.block_t, "BLOCK_I": SWIGLU_TILES.block_i},
                                SWIGLU_TILES.num_warps, 1).asm["ptx"]
        assert "ld.global.v4" in ptx, f"{kernel.__name__}: fc1 not loaded in 16-byte vectors"


# ---------------------------------------------------------------------------------------------- refusals

not_interpreted = pytest.mark.skipif(triton_support.INTERPRETED, reason="this pytest process runs TRITON_INTERPRET=1")


@not_interpreted
def test_triton_choices_refuse_cpu_tensors_outside_the_interpreter():
    from moe.experts import _WgradPlan

    with pytest.raises(ImplementationError, match="accumulation 'triton' cannot run here: .*need CUDA tensors"):
        _WgradPlan("triton", [1, 2], torch.device("cpu"))
    fc1_TF, probs_T = torch.randn(3, 8), torch.rand(3)
    with pytest.raises(ImplementationError, match="expert_activation=fused cannot run here"):
        swiglu_probs_forward(fc1_TF, probs_T)
    with pytest.raises(ImplementationError, match="accumulation 'triton' cannot run here"):
        grouped_wgrad_accumulate(torch.zeros(1, 8, 3), fc1_TF, torch.randn(3, 3), torch.tensor([3], dtype=torch.int32))
    assert not uses_triton(torch.device("cpu"))  # `fused` on the CPU: the torch reference (below)
    assert _WgradPlan("auto", [1, 2], torch.device("cuda")).mode == "add"  # not the default until measured


def test_missing_triton_is_reported_naming_the_choice(monkeypatch):
    from moe.experts import _WgradPlan

    monkeypatch.setattr(triton_support, "triton", None)
    monkeypatch.setattr(triton_support, "TRITON_IMPORT_ERROR", "ModuleNotFoundError: No module named 'triton'")
    for device in ("cpu", "cuda"):
        with pytest.raises(ImplementationError, match="'triton' cannot run here: triton does not import"):
            _WgradPlan("triton", [1, 2], torch.device(device))
    with pytest.raises(ImplementationError, match="fused cannot run here: triton does not import"):
        uses_triton(torch.device("cuda"))  # a CUDA run asked for the kernel: never a silent stand-in


def test_fused_activation_needs_swiglu_and_a_known_name():
    from moe.experts import _checked_activation

    config = SimpleNamespace(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    assert _checked_activation("fused", config) == "fused"
    config.activation_func = torch.nn.functional.gelu
    with pytest.raises(ImplementationError, match="fused computes SwiGLU only.*activation_func=gelu"):
        _checked_activation("fused", config)
    assert _checked_activation("torch", config) == "torch"
    with pytest.raises(ImplementationError, match="model.expert_activation must be one of torch, fused"):
        _checked_activation("triton", config)
    with pytest.raises(ImplementationError, match="model.expert_activation must be one of"):
        ModelImplementation(expert_activation="liger")
    assert ModelImplementation(expert_wgrad="triton").expert_activation == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_probs_torch_path_is_the_unfused_path_bit_for_bit(dtype):
    """`fused` without Triton (the CPU): the unfused ops, recomputed in backward from fc1 and probs only."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator().manual_seed(seed)
    fc1_TF, probs_T = (3 * torch.randn(37, 48, generator=gen)).to(dtype), torch.rand(37, generator=gen)
    dout_TI = torch.randn(37, 24, generator=gen).to(dtype)
    runs = []
    for fused in (True, False):
        f, p = fc1_TF.clone().requires_grad_(True), probs_T.clone().requires_grad_(True)
        out_TI = SwigluProbs.apply(f, p, False) if fused else swiglu_probs_reference(f, p)
        out_TI.backward(dout_TI)
        runs.append((out_TI.detach(), f.grad, p.grad))
    for label, got, expected in zip(("out", "d fc1", "d probs"), *runs):
        assert torch.equal(got, expected), f"seed {seed} {dtype} {label}"


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_triton_kernels_on_cuda_fp32_fp16_bf16():
    """Compiled kernels (wgmma on sm90) in every dtype, on the small odd shapes and on one the default tiles
    cover several times; the same checks as in the interpreter."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for counts, n, k, i in ((COUNTS, N, K, I), (GPU_COUNTS, GPU_N, GPU_K, GPU_I)):
        wgrad, swiglu = run_distributed(_kernels_body, world_size=1, args=(seed, "cuda", dtypes, counts, n, k, i),
                                        env=cuda_env(), timeout_s=300)[0]
        for dtype in dtypes:
            _check_wgrad(seed, wgrad, dtype, counts, n, k)
        _check_swiglu(seed, swiglu, dtypes)


@pytest.mark.gpu
def test_grouped_experts_triton_and_fused_under_ddp_on_cuda():
    """GroupedGemmExperts fwd + bwd under Megatron DDP on a GPU, fp32 and bf16: `triton` + `fused` against
    `add` + `torch` (bf16: within twice add's error against fp32 math on the same weights)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    arch = tiny_arch("moe", num_experts=len(MODULE_COUNTS), moe_intermediate_size=24)
    out = run_distributed(_module_body, world_size=1,
                          args=(seed, (torch.float32, torch.bfloat16), arch, MODULE_COUNTS),
                          env=cuda_env(), timeout_s=300)[0]
    _check_module(seed, out, torch.float32)
    _check_module(seed, out, torch.bfloat16)
