"""MoE experts as two torch grouped GEMMs over all local experts, in place of a Python loop of matmuls.

Shape legend: T routed token copies on this rank (sorted by local expert), H hidden, E local experts,
F fc1 output width (2 I with SwiGLU: [gate; up]), I expert FFN width on this expert-TP rank.

`GroupedGemmExperts` is Megatron's SequentialMLP with its forward replaced: the module tree, the parameters
(`local_experts.{e}.linear_fc1.weight` [F, H], `local_experts.{e}.linear_fc2.weight` [H, I]), their tensor-
and expert-parallel attributes and `sharded_state_dict` are Megatron's own, so checkpoints, HF conversion,
the weight sync and Megatron's DDP / distributed optimizer see exactly what they saw with SequentialMLP.
The forward runs `torch.nn.functional.grouped_mm` on CPU and CUDA alike. On CUDA, torch runs its grouped
GEMM kernel for bf16 on sm90+; other dtypes (fp32) take torch's per-group fallback.

The [E, N, K] weight operand without a copy (`expert_weights_ENK`). Megatron's DistributedDataParallel with
the distributed optimizer (`moe.optimizer.wrap_data_parallel`) re-points every `param.data` at a slice of one
contiguous parameter buffer per (dtype, dense / expert) group, walking the parameters in REVERSE
`named_parameters` order (megatron-core 0.16.1 `_ParamAndGradBuffer.__init__`: `for param in params[::-1]`),
each start padded to 64 elements, a bucket's end padded to lcm(DP, 128) elements. For SequentialMLP's order
(expert 0 fc1, expert 0 fc2, expert 1 fc1, ...) that puts expert e+1 BELOW expert e: descending addresses,
which no strided view can read in ascending expert order (strides cannot be negative). So this module
registers its experts from the last to the first (`_ExpertList`: `named_parameters`, `state_dict` and the
module tree's children list expert E-1 first, while indexing, iteration, names and `sharded_state_dict` stay
0..E-1): DDP's reversed walk then lays expert e's fc1 at base1 + e S and its fc2 at base2 + e S, S = the padded
size of one expert's fc1 + fc2, and `torch.as_strided` reads all local experts' fc1 (or fc2) as one
[E, N, K] tensor with an expert stride of S, at no cost. `grouped_mm` takes any expert stride (its CUDA kernel
computes group g's pointer as base + g * stride(0); the check here also asks for 16-byte aligned groups).
Where the weights are not laid out that way (a model not wrapped in DDP, or with a bucket boundary that adds
padding between two experts) the forward stacks a transient copy, counted in `STACK_FALLBACKS` and logged once
per kind (a warning for trained weights, info for a frozen model such as the KL reference), and backward
stacks again rather than keeping the copy alive until then.
Why not stack once and save it for backward: that halves the copies but keeps an [E, F, H] + [E, H, I] copy
of every MoE layer alive from forward to backward (1.2 GB per layer at Qwen3-30B-A3B width and EP=1, 58 GB
for 48 layers); the view costs nothing and reads the very weights the optimizer updates. Measured on the
2-core CPU box (bf16, E = 32 experts at Qwen3-30B-A3B width, 302 MB): stacking fc1 + fc2 once 564 ms, the
checked view 0.08 ms. On an H200 (torch 2.11, bf16, E = 32, 8,192 tokens, 2026-11-26): the fc1 forward took
0.189 ms with the stack, 0.091 ms on the view, bit-identical outputs. At those widths every expert tensor is a multiple of 128 elements, so DDP's padding adds no
gap at bucket boundaries for DP in {1, 2, 4, 8, ...} and the view holds across buckets.

Gradients: under Megatron DDP every expert weight has an fp32 `main_grad` (a slice of DDP's gradient buffer,
which mirrors the parameter buffer), and the weight gradient is accumulated into it here, each weight then
marked `grad_added_to_main_grad` (Megatron's protocol: its grad-ready hook skips its own add; the per-expert
hook adds were 4,152 kernels and 12% of a 4-micro-batch step's device time on an H200). How (`_WgradPlan`,
`wgrad_accumulation`): one grouped GEMM and one add of all experts at once into the [E, N, K] view of
main_grad, or (`triton`, moe.triton_wgrad) one grouped Triton GEMM that adds its fp32 tiles into main_grad
directly. (Per-expert cuBLAS GEMMs accumulating into main_grad in place, Megatron's
gradient_accumulation_fusion, are the `addmm` mode: slower here, see WGRAD_ACCUMULATIONS.) Without DDP's buffer the gradient is unbound into per-expert gradients that go
through autograd as for any parameter.

Expert-TP needs no communication here: Megatron's expert linears are "explicit expert comm" layers whose
forward is a local matmul on this rank's weight shard (the token dispatcher gathers and reduce-scatters),
and a local grouped matmul on the same shards computes the same.
"""

from __future__ import annotations

import collections
import logging

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from moe import cuda_calls, triton_wgrad
from moe.implementation import EXPERT_ACTIVATIONS, ImplementationError
from moe.optimizer import gradient_added_to_main_grad, takes_gradient_in_main_grad
from moe.triton_support import require_triton
from moe.triton_swiglu import SwigluProbs, uses_triton

logger = logging.getLogger(__name__)

# torch's grouped GEMM wants every row stride of its operands, and each group's start, at a multiple of 16 bytes
_GROUPED_MM_ALIGN_BYTES = 16

# why the forward / backward stacked the expert weights instead of viewing them -> how many times (per process)
STACK_FALLBACKS: collections.Counter = collections.Counter()


class _ExpertList(torch.nn.ModuleList):
    """The local experts, indexed and iterated 0..E-1 like a ModuleList, but registered last to first, so
    that `named_parameters` (which Megatron's DDP lays out in reverse) lists expert E-1 first. See the module
    docstring. Names (`local_experts.{e}.`) are unchanged; only the order of the registration dict differs."""

    def __init__(self, experts):
        super().__init__()
        experts = list(experts)
        for e in reversed(range(len(experts))):
            self.add_module(str(e), experts[e])

    def __iter__(self):
        return iter([self._modules[str(e)] for e in range(len(self))])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return torch.nn.ModuleList(list(self)[idx])
        return super().__getitem__(idx)

    def append(self, module):  # ModuleList.append/extend/insert assume insertion order == index order
        raise TypeError("the local experts of GroupedGemmExperts are fixed at construction")

    extend = insert = append


def expert_weights_ENK(weights_NK) -> torch.Tensor | None:
    """The per-expert weights [N, K] as one [E, N, K] view when they are equally spaced, ascending, 16-byte
    aligned row-major slices of one storage (Megatron DDP's parameter buffer, see the module docstring);
    None otherwise. No copy; checks E data pointers (~10 us at E = 128) and the first and last tensor's
    storage, shape, layout and dtype (a tensor between two of one live storage lies in that storage)."""
    first, last = weights_NK[0], weights_NK[-1]
    n, k = first.shape
    num = len(weights_NK)
    item = first.element_size()
    step = weights_NK[1].data_ptr() - first.data_ptr() if num > 1 else n * k * item
    if step < n * k * item or step % _GROUPED_MM_ALIGN_BYTES or first.data_ptr() % _GROUPED_MM_ALIGN_BYTES:
        return None
    start = first.data_ptr()
    if [w.data_ptr() for w in weights_NK] != list(range(start, start + num * step, step)):
        return None
    for w in (first, last):
        if (w.shape != (n, k) or w.stride() != (k, 1) or w.dtype != first.dtype or w.device != first.device
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
    return first.detach().as_strided((num, n, k), (step // item, k, 1), first.storage_offset())


def _stacked_ENK(weights_NK, where: str) -> torch.Tensor:
    """The [E, N, K] operand: the zero-copy view when the layout allows, else a stacked copy (counted, logged
    once per `where`)."""
    view = expert_weights_ENK(weights_NK)
    if view is not None:
        return view
    trained = any(w.requires_grad for w in weights_NK)
    key = f"{where}, {'trained' if trained else 'frozen'}"
    if not STACK_FALLBACKS[key]:
        # a frozen model (the KL reference: no DDP, forward only) is expected here; a trained one is not
        logger.log(logging.WARNING if trained else logging.INFO,
                   "moe.experts: the local expert weights are not equally spaced ascending views of one buffer "
                   "(%s; e.g. a model not wrapped in Megatron DDP with the distributed optimizer, or a gradient-"
                   "bucket boundary between two experts): stacking a copy of them per call", key)
    STACK_FALLBACKS[key] += 1
    return torch.stack(weights_NK)


def expert_offsets(tokens_per_expert_E, device: torch.device) -> torch.Tensor:
    """offs[e] = end row of expert e (int32, on `device`); an expert with no token has an empty group.

    Megatron's dispatchers hand the counts over on the host (the alltoall dispatcher copies them to the CPU at
    its sync point, the allgather one calls `.cpu()`), so on CUDA the cumulative sum is made on the host and
    sent from pinned memory without blocking (a pageable tensor's `.to(cuda)` would wait for the stream);
    counts already on the device stay there."""
    if torch.is_tensor(tokens_per_expert_E) and tokens_per_expert_E.device == torch.device(device):
        return torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
    offs_E = torch.cumsum(torch.as_tensor(tokens_per_expert_E).cpu(), 0).to(torch.int32)
    if torch.device(device).type != "cuda":
        return offs_E.to(device)
    return offs_E.pin_memory().to(device, non_blocking=True)


class GroupedGemmExperts(SequentialMLP):
    """Megatron's SequentialMLP parameters, computed with `torch.nn.functional.grouped_mm`."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, wgrad_accumulation="auto",
                 activation="torch"):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        config = self.config
        if wgrad_accumulation not in WGRAD_ACCUMULATIONS:
            raise ImplementationError(f"expert weight-gradient accumulation must be one of "
                                      f"{', '.join(WGRAD_ACCUMULATIONS)}; got {wgrad_accumulation!r}")
        self.wgrad_accumulation = wgrad_accumulation
        self.activation = _checked_activation(activation, config)
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "fp8": bool(config.fp8),
            "fp4": bool(getattr(config, "fp4", None)),
            "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None) is not None,
            "glu_linear_offset": bool(getattr(config, "glu_linear_offset", 0.0)),
            "use_te_activation_func": bool(getattr(config, "use_te_activation_func", False)),
        }
        for field, on in unsupported.items():
            if on:
                raise ImplementationError(f"model.experts=grouped does not support TransformerConfig.{field}; "
                                          "use model.experts=sequential")
        fc1_FH = self.local_experts[0].linear_fc1.weight
        fc2_HI = self.local_experts[0].linear_fc2.weight
        item = fc1_FH.element_size()
        for what, width in (("hidden_size", fc1_FH.shape[1]), ("fc1 width", fc1_FH.shape[0]),
                            ("expert FFN width per expert-TP rank", fc2_HI.shape[1])):
            if (width * item) % _GROUPED_MM_ALIGN_BYTES:
                raise ImplementationError(
                    f"model.experts=grouped: torch grouped_mm needs rows of a multiple of "
                    f"{_GROUPED_MM_ALIGN_BYTES} bytes, but the {what} is {width} x {item} B; use widths that "
                    f"are multiples of {_GROUPED_MM_ALIGN_BYTES // item} or model.experts=sequential")
        # before DDP exists (it is built around the finished model): registration order = buffer order
        self.local_experts = _ExpertList(self.local_experts)

    def _activation(self, fc1_TF: torch.Tensor) -> torch.Tensor:
        """Megatron MLP's unfused activation: SwiGLU act(gate) * up on [gate; up], else act(fc1)."""
        if self.config.gated_linear_unit:
            gate_TI, up_TI = torch.chunk(fc1_TF, 2, dim=-1)
            return self.config.activation_func(gate_TI) * up_TI
        return self.config.activation_func(fc1_TF)

    def forward(self, hidden_TH: torch.Tensor, tokens_per_expert_E: torch.Tensor, probs_T: torch.Tensor):
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ImplementationError("moe_apply_probs_on_input needs moe_router_topk = 1")
            hidden_TH = (probs_T.unsqueeze(-1) * hidden_TH).to(hidden_TH.dtype)
            probs_T = torch.ones_like(probs_T)
        offs_E = expert_offsets(tokens_per_expert_E, hidden_TH.device)
        experts = list(self.local_experts)
        wgrad = _WgradPlan(self.wgrad_accumulation, tokens_per_expert_E, hidden_TH.device)
        fc1_TF = GroupedLinear.apply(hidden_TH, offs_E, wgrad, *(e.linear_fc1.weight for e in experts))
        if self.activation == "fused":  # the same roundings in one kernel each way (moe.triton_swiglu)
            act_TI = SwigluProbs.apply(fc1_TF, probs_T, uses_triton(fc1_TF.device))
        else:
            act_TI = self._activation(fc1_TF)
            # the router weight in the router's dtype (fp32), cast back, as Megatron's MLP does
            act_TI = (act_TI * probs_T.unsqueeze(-1)).to(fc1_TF.dtype)
        out_TH = GroupedLinear.apply(act_TI, offs_E, wgrad, *(e.linear_fc2.weight for e in experts))
        return out_TH, None


def _checked_activation(activation: str, config) -> str:
    """`activation` ("torch": Megatron's unfused ops; "fused": SwiGLU x probs in one kernel each way,
    moe.triton_swiglu), refused where the model's activation is not SwiGLU."""
    if activation not in EXPERT_ACTIVATIONS:
        raise ImplementationError(f"model.expert_activation must be one of {', '.join(EXPERT_ACTIVATIONS)}; "
                                  f"got {activation!r}")
    if activation == "fused" and not (config.gated_linear_unit
                                      and config.activation_func is torch.nn.functional.silu):
        raise ImplementationError(f"model.expert_activation=fused computes SwiGLU only; this model has "
                                  f"gated_linear_unit={config.gated_linear_unit}, activation_func="
                                  f"{getattr(config.activation_func, '__name__', config.activation_func)}: use "
                                  "model.expert_activation=torch")
    return activation


class GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] @ W_e^T for per-expert weights W_e [N, K] (legend: N output,
    K input features), on one grouped GEMM. The weights enter as separate tensors (each keeps its own
    AccumulateGrad and DDP hook); the [E, N, K] operand is a view of them where the layout allows
    (`expert_weights_ENK`), else a stacked copy made in forward and again in backward rather than saved.
    `wgrad` (a `_WgradPlan`) says how the weight gradient reaches DDP's fp32 `main_grad`."""

    @staticmethod
    def forward(ctx, x_TK, offs_E, wgrad, *weights_NK):
        ctx.save_for_backward(x_TK, offs_E, *weights_NK)
        ctx.wgrad = wgrad
        return cuda_calls.grouped_mm(x_TK, _stacked_ENK(weights_NK, "forward").transpose(1, 2), offs_E)

    @staticmethod
    def backward(ctx, dy_TN):
        x_TK, offs_E, *weights_NK = ctx.saved_tensors
        dy_TN = dy_TN.contiguous()
        dx_TK = None
        if ctx.needs_input_grad[0]:
            dx_TK = cuda_calls.grouped_mm(dy_TN, _stacked_ENK(weights_NK, "backward"), offs_E)
        dweights = [None] * len(weights_NK)
        if any(ctx.needs_input_grad[3:]):
            dweights = ctx.wgrad.weight_gradients(dy_TN, x_TK, offs_E, weights_NK)
        return (dx_TK, None, None, *dweights)


# How the experts' weight gradient dW_e = dy_e^T x_e reaches Megatron DDP's fp32 `main_grad` buffer (where it
# has one; otherwise every mode returns per-expert gradients through autograd):
#   add      one grouped GEMM into a bf16/fp32 [E, N, K] gradient, then ONE add of it into the [E, N, K] view of
#            main_grad (the CPU's path; exact as Megatron's per-expert hook adds)
#   foreach  the same grouped GEMM, then one multi-tensor add over the E per-expert main_grads (torch's foreach
#            kernel: no strided [E, N, K] indexing)
#   addmm    per expert, one cuBLAS GEMM with an fp32 output accumulated in place (beta = 1) into main_grad:
#            Megatron's gradient_accumulation_fusion, as TE's grouped linear does it; no bf16 gradient exists
#            and no separate add runs. CUDA only (torch's addmm with out_dtype). Measured slower: one GEMM launch
#            per expert (1,024 per micro-batch at 4 layers x 128 experts x 2 linears) leaves the device waiting
#            for the host (H200, 2026-11-26, bench_train_step at Qwen3-30B-A3B width: 116 ms per micro-batch
#            against 79 ms with `add`); kept as the measured alternative.
#   triton   one grouped Triton GEMM per linear that adds each fp32 output tile into main_grad in its epilogue
#            (moe.triton_wgrad): no bf16 gradient, main_grad read and written once. CUDA with Triton only (the
#            tests also run it in Triton's CPU interpreter). Not the default until measured on a GPU.
#   auto     add (every device)
WGRAD_ACCUMULATIONS = ("auto", "add", "foreach", "addmm", "triton")


class _WgradPlan:
    """One experts call's weight-gradient accumulation: the mode (`auto` resolved by device) and the per-
    expert token counts on the host, which the per-expert GEMMs of `addmm` slice the tokens by."""

    def __init__(self, mode: str, tokens_per_expert_E, device: torch.device):
        self.mode = mode
        if mode == "auto":
            self.mode = "add"
        self.counts = None
        if self.mode == "addmm":
            if torch.device(device).type != "cuda":
                raise ImplementationError("expert weight-gradient accumulation 'addmm' needs CUDA (torch's addmm "
                                          "with an fp32 out_dtype); use 'add' or 'foreach' on this device")
            counts = torch.as_tensor(tokens_per_expert_E)
            if counts.device.type != "cpu":  # never synchronise for it: Megatron's dispatchers give host counts
                raise ImplementationError("expert weight-gradient accumulation 'addmm' needs the token counts per "
                                          "expert on the host; this dispatcher gave them on the device")
            self.counts = counts.tolist()
        if self.mode == "triton":
            require_triton(triton_wgrad.CHOICE, device)

    def weight_gradients(self, dy_TN, x_TK, offs_E, weights_NK) -> list:
        if not all(takes_gradient_in_main_grad(w) for w in weights_NK):
            return list(cuda_calls.grouped_mm(dy_TN.t(), x_TK, offs_E).unbind(0))
        mains_NK = [w.main_grad for w in weights_NK]
        if self.mode == "addmm":
            start = 0
            for main_NK, count in zip(mains_NK, self.counts):
                if count:
                    rows = slice(start, start + count)
                    if x_TK.dtype == main_NK.dtype:
                        main_NK.addmm_(dy_TN[rows].t(), x_TK[rows])
                    else:
                        cuda_calls.addmm_out_dtype(main_NK, dy_TN[rows].t(), x_TK[rows])
                start += count
            return [gradient_added_to_main_grad(w) for w in weights_NK]
        if self.mode == "triton":  # the [E, N, K] view of DDP's buffer, else a table of the E main_grads
            main_ENK = expert_weights_ENK(mains_NK)
            triton_wgrad.grouped_wgrad_accumulate(mains_NK if main_ENK is None else main_ENK, dy_TN, x_TK, offs_E)
            return [gradient_added_to_main_grad(w) for w in weights_NK]
        # dW_e = dy_e^T x_e: both operands split along the token dimension; an empty expert gets zeros
        dw_ENK = cuda_calls.grouped_mm(dy_TN.t(), x_TK, offs_E)
        main_ENK = expert_weights_ENK(mains_NK) if self.mode == "add" else None
        if main_ENK is not None:
            # all experts' gradients in one add, instead of one hook add per expert (1,024 kernels per
            # micro-batch at 4 layers x 128 experts x 2 linears)
            main_ENK.add_(dw_ENK)
        else:
            torch._foreach_add_(mains_NK, list(dw_ENK.unbind(0)))
        return [gradient_added_to_main_grad(w) for w in weights_NK]


