"""MoE experts as two torch grouped GEMMs over all local experts, in place of a Python loop of matmuls.

Shape legend: T routed token copies on this rank (sorted by local expert), H hidden, E local experts,
F fc1 output width (2 I with SwiGLU: [gate; up]), I expert FFN width on this expert-TP rank.

`GroupedGemmExperts` is Megatron's SequentialMLP with its forward replaced: the module tree, the parameters
(`local_experts.{e}.linear_fc1.weight` [F, H], `local_experts.{e}.linear_fc2.weight` [H, I]), their tensor-
and expert-parallel attributes and `sharded_state_dict` are Megatron's own, so checkpoints, HF conversion,
the weight sync and Megatron's DDP / distributed optimizer see exactly what they saw with SequentialMLP.
The forward stacks the per-expert weights into [E, F, H] / [E, H, I] (a transient copy of the local expert
weights, made again in backward, never kept between the two: `GroupedLinear`) and runs
`torch.nn.functional.grouped_mm` on CPU and CUDA alike. On CUDA,
torch runs its grouped GEMM kernel for bf16 on sm90+; other dtypes (fp32) take torch's per-group fallback.

Expert-TP needs no communication here: Megatron's expert linears are "explicit expert comm" layers whose
forward is a local matmul on this rank's weight shard (the token dispatcher gathers and reduce-scatters),
and a local grouped matmul on the same shards computes the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from moe.implementation import ImplementationError

# torch's grouped GEMM wants every row stride of its operands to be a multiple of 16 bytes
_GROUPED_MM_ALIGN_BYTES = 16


class GroupedGemmExperts(SequentialMLP):
    """Megatron's SequentialMLP parameters, computed with `torch.nn.functional.grouped_mm`."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        config = self.config
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
        # offs[e] = end row of expert e; an expert with no token has an empty group (offs[e] == offs[e-1])
        offs_E = torch.cumsum(torch.as_tensor(tokens_per_expert_E), 0).to(device=hidden_TH.device,
                                                                          dtype=torch.int32)
        fc1_TF = GroupedLinear.apply(hidden_TH, offs_E, *(e.linear_fc1.weight for e in self.local_experts))
        act_TI = self._activation(fc1_TF)
        # the router weight in the router's dtype (fp32), cast back, as Megatron's MLP does
        act_TI = (act_TI * probs_T.unsqueeze(-1)).to(fc1_TF.dtype)
        out_TH = GroupedLinear.apply(act_TI, offs_E, *(e.linear_fc2.weight for e in self.local_experts))
        return out_TH, None


class GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] @ W_e^T for per-expert weights W_e [N, K] (legend: N output,
    K input features), on one grouped GEMM. The weights are stacked into [E, N, K] for the GEMM and stacked
    again in backward rather than saved: autograd through `torch.stack` would keep that copy of every local
    expert weight alive from each MoE layer's forward to its backward."""

    @staticmethod
    def forward(ctx, x_TK, offs_E, *weights_NK):
        ctx.save_for_backward(x_TK, offs_E, *weights_NK)
        return F.grouped_mm(x_TK, torch.stack(weights_NK).transpose(1, 2), offs=offs_E)

    @staticmethod
    def backward(ctx, dy_TN):
        x_TK, offs_E, *weights_NK = ctx.saved_tensors
        dy_TN = dy_TN.contiguous()
        dx_TK = None
        if ctx.needs_input_grad[0]:
            dx_TK = F.grouped_mm(dy_TN, torch.stack(weights_NK), offs=offs_E)
        dweights = [None] * len(weights_NK)
        if any(ctx.needs_input_grad[2:]):
            # dW_e = dy_e^T x_e: both operands split along the token dimension; an empty expert gets zeros
            dw_ENK = F.grouped_mm(dy_TN.t(), x_TK, offs=offs_E)
            dweights = list(dw_ENK.unbind(0))
        return (dx_TK, None, *dweights)
