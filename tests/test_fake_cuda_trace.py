"""The GPU step's own CUDA branches, traced on the CPU: tensors made with device="cuda" under torch's
FakeTensorMode report `is_cuda` on a CUDA-less torch and carry shapes, dtypes and devices through most ops (their
meta kernels), so the project code takes its CUDA branches and a device mix, a dtype mismatch, a shape error or
a call that the GPU host's torch would refuse raises here, as it would on the GPU.

Traced (forward, no_grad): the packed attention's varlen flash branch, against the installed torch and against
a stand-in with the GPU host's torch 2.11 `varlen_attn` signature (the call at 14e93b1 raises the H100's
TypeError there); the three RL losses; the fused kernels' entry points (`torch.ops.megagspo.*`, their fake
implementations) with the CUDA dispatch chosen; the grouped experts' GEMM.

What such a trace cannot do on a CPU-only torch (measured on torch 2.13.0+cpu; `test_what_fake_cuda_cannot_do`
keeps each limit honest, so a torch that lifts one fails there and the trace can grow):
- backward: autograd's AccumulateGrad asks for a CUDA device guard, and the process aborts (SIGABRT, not an
  exception) the moment a graph is recorded on a 'cuda' parameter: the trace runs under no_grad;
- Python indexing (`x[1:]`, `x[idx]`) and `~x` of a 'cuda' tensor take that device guard too (a RuntimeError):
  the losses' trace runs under `CudaIndexing`, which gives the same results' geometry another way;
- the Megatron model: its rotary table is made on `torch.cuda.current_device()` (the CPU shim's 'cpu': a device
  mix; without the shim, `torch.accelerator` refuses: no device), and the packed (THD) RoPE and the MoE token
  dispatch read counts back to the host (`.tolist()`: data-dependent, DataDependentOutputException). A whole
  model step on fake CUDA would need those pieces replaced; the GPU window's first stage (tiny-bf16) runs it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from moe import cuda_calls
from test_algo_common import every_input_batch, random_packed
from test_cuda_contract import LENGTHS, RECORDED, _packed_attention_module

VARLEN = "torch.nn.attention.varlen.varlen_attn"


def _meta_twin(index):
    if isinstance(index, torch.Tensor):
        return torch.empty_strided(index.shape, index.stride(), dtype=index.dtype, device="meta")
    if isinstance(index, (tuple, list)):
        return type(index)(_meta_twin(i) for i in index)
    return index


class CudaIndexing(TorchFunctionMode):
    """`x[index]` and `~x` of a fake 'cuda' tensor, which a CUDA-less torch refuses (their hand-written Python
    bindings take a CUDA device guard): indexing gets the result's geometry from the same index on a meta twin
    (a view for ints, slices, None, ...; a new tensor for advanced indexing), `~x` is torch.bitwise_not(x).
    Forward traces only (no autograd through it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], FakeTensor) and args[0].device.type == "cuda":
            x, index = args
            with torch._C.DisableTorchFunction(), unset_fake_temporarily():
                twin = _meta_twin(x)[_meta_twin(index)]
            items = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, (torch.Tensor, list)) for i in items):
                return torch.empty_strided(twin.shape, twin.stride(), dtype=twin.dtype, device=x.device)
            return x.as_strided(twin.shape, twin.stride(), x.storage_offset() + twin.storage_offset())
        if func is torch.Tensor.__invert__ and isinstance(args[0], FakeTensor):
            return torch.bitwise_not(args[0])  # the same op, without the binding's device guard
        return func(*args, **(kwargs or {}))


def _gpu_host_varlen(api_name, fn, args, kwargs):
    """torch 2.11's varlen_attn as far as a CPU can play it: its signature (a keyword it lacks raises the same
    TypeError), then the output of the flash kernel's shape."""
    if api_name != VARLEN:
        return cuda_calls.CALL_THROUGH
    cuda_calls.as_signature(RECORDED["apis"][VARLEN]["overloads"][0]).bind(*args, **kwargs)
    return torch.empty_like(args[0])


def _packed_attention_trace(dtype, groups):
    from moe.model import PackedSequences

    module = _packed_attention_module(groups=groups)
    total = sum(LENGTHS)
    seen = []
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        params = PackedSequences.from_lengths(LENGTHS, device="cuda").megatron_params()
        q = torch.randn(total, 4, 8, dtype=dtype, device="cuda")
        k, v = (torch.randn(total, groups, 8, dtype=dtype, device="cuda") for _ in range(2))
        with cuda_calls.intercept(lambda name, fn, args, kwargs: seen.append(name) or cuda_calls.CALL_THROUGH):
            out = module(q, k, v, None, packed_seq_params=params)
    return out, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_packed_attention_traces_on_fake_cuda(dtype, groups):
    """The installed torch: the varlen branch is taken once per layer call, output [T, N*D] on 'cuda'."""
    out, seen = _packed_attention_trace(dtype, groups)
    assert seen == [VARLEN]
    assert out.shape == (sum(LENGTHS), 32) and out.device.type == "cuda" and out.dtype == dtype


def test_packed_attention_traces_against_the_gpu_host_torch():
    """Built as the GPU host's torch 2.11 detects it, the call fits 2.11's varlen_attn."""
    with cuda_calls.detecting_against(RECORDED), cuda_calls.intercept(_gpu_host_varlen):
        out, seen = _packed_attention_trace(torch.bfloat16, 2)
    assert seen == [VARLEN] and out.shape == (sum(LENGTHS), 32)


def test_the_14e93b1_call_raises_the_h100_error_in_the_trace(monkeypatch):
    """The call as 14e93b1 made it (enable_gqa whatever the torch) raises, on the CPU, the TypeError the H100 did."""
    monkeypatch.setattr(cuda_calls, "takes_keyword", lambda api_name, keyword: True)
    with cuda_calls.intercept(_gpu_host_varlen):
        with pytest.raises(TypeError, match="unexpected keyword argument 'enable_gqa'"):
            _packed_attention_trace(torch.bfloat16, 2)


def test_fp32_packed_attention_on_fake_cuda_takes_the_sdpa_branch():
    """fp32 (no flash kernel): per-sequence SDPA, never the varlen call. Its `.tolist()` of cu_seqlens is a host
    read of a device tensor, which the trace reports as data-dependent: the branch syncs the GPU, by design."""
    with pytest.raises(Exception, match="_local_scalar_dense|DataDependent"):
        _packed_attention_trace(torch.float32, 2)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_rl_losses_trace_on_fake_cuda(name):
    """The RL losses on bf16 'cuda' log-probs: the loss and every metric stay on the device (no device mix, no
    host read), in float32."""
    from megagspo.algorithm import get_loss

    b = random_packed(torch.Generator().manual_seed(0), num_seqs=6, max_len=9)
    with FakeTensorMode(allow_non_fake_inputs=True), CudaIndexing(), torch.no_grad():
        on = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in b.items()}
        logp = torch.empty(on["logp"].shape, dtype=torch.bfloat16, device="cuda")
        batch, cfg = every_input_batch(name, on, logp, num_global_sequences=6, num_global_tokens=40)
        loss, metrics = get_loss(name)(batch, cfg)
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    assert all(v.device.type == "cuda" for v in metrics.values()), {k: v.device for k, v in metrics.items()}


def test_fused_kernel_entry_points_trace_on_fake_cuda(monkeypatch):
    """With CUDA kernels (as a MEGAGSPO_CUDA=1 build has), token_logprobs and gspo_segment_loss call the
    megagspo ops on 'cuda' tensors; their fake implementations check the arguments the project passes."""
    import megagspo.kernels as K
    from megagspo.kernels import _ops

    if K.extension_error() is not None:
        pytest.skip(f"megagspo._C not built (make ext): {K.extension_error()}")
    monkeypatch.setattr(_ops, "DEVICE_KERNELS", frozenset({"cpu", "cuda"}))
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        logits = torch.empty(12, 50, dtype=torch.bfloat16, device="cuda")
        target = torch.zeros(12, dtype=torch.long, device="cuda")
        logp, entropy = K.token_logprobs(logits, target, with_entropy=True, impl="fused")
        cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
        loss, metrics = K.gspo_segment_loss(logp, logp.float(), torch.ones(12, dtype=torch.bool, device="cuda"), cu,
                                            torch.zeros(2, device="cuda"), num_global_sequences=2, impl="fused")
    assert logp.shape == (12,) and logp.device.type == "cuda" and entropy.shape == (12,)
    assert loss.device.type == "cuda"


def test_grouped_experts_gemm_traces_on_fake_cuda():
    from test_cuda_contract import drive_grouped_mm

    seen = []
    with cuda_calls.intercept(lambda name, fn, args, kwargs: seen.append(name) or cuda_calls.CALL_THROUGH):
        drive_grouped_mm()
    assert seen == ["torch.nn.functional.grouped_mm"]


_ABORTS_ON_BACKWARD = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    w = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
    (torch.empty(2, 4, device="cuda") @ w).sum()
print("recorded a graph")
"""


def test_what_fake_cuda_cannot_do():
    """The limits the module docstring states, measured: if a torch lifts one, this fails and the trace can grow."""
    if torch.cuda.is_available():
        pytest.skip("the limits are those of a CUDA-less torch")
    proc = subprocess.run([sys.executable, "-c", _ABORTS_ON_BACKWARD], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "recorded a graph" not in proc.stdout
    assert "not linked with support for cuda devices" in proc.stderr
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(6, device="cuda")
        with pytest.raises(RuntimeError, match="not linked with support for cuda"):
            x[1:]
        assert x.narrow(0, 1, 5).shape == (5,)  # the same view through an op works
