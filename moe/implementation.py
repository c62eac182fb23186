"""Which implementation runs each part of the Megatron-Core model: the experts, the core attention, and the
activation recompute. The architecture (moe.architecture) fixes what the model computes; these choices only
change how, so every choice computes the same function (tests/test_moe_grouped_experts.py,
tests/test_moe_sdpa_attention.py, tests/test_moe_recompute.py,
tests/test_moe_token_dispatch.py).

  experts   grouped     one torch grouped GEMM per projection over all local experts (moe.experts)
            sequential  Megatron's SequentialMLP: a Python loop of per-expert matmuls (the earlier default)
  attention sdpa        torch scaled_dot_product_attention (flash on CUDA, native GQA) (moe.attention)
            local       Megatron's DotProductAttention (materialises [B, heads, S, S] scores)
  dispatcher fast       Megatron's all-to-all token dispatcher without its identity chunk sort (TP x EP = 1),
                        with an atomic-free sum of each token's expert outputs, and at EP = TP = 1 with grouped
                        experts without a host synchronisation (permutation and counts stay on the device)
                        (moe.token_dispatch)
            megatron    Megatron's MoEAlltoAllTokenDispatcher as it is
  recompute none        every activation is kept for backward
            selective   Megatron's selective recompute of the core attention and the whole MoE layer (router,
                        dispatch, experts, combine): the MoE layer keeps only its input
            full        Megatron's full recompute, one layer per checkpoint: each layer keeps only its input
  expert_wgrad          how the grouped experts' weight gradients reach DDP's fp32 main_grad (auto = add, foreach,
                        addmm, triton: moe.experts.WGRAD_ACCUMULATIONS)
  expert_activation     the grouped experts' SwiGLU x routing probability: torch (Megatron's unfused ops) or fused
                        (one Triton kernel forward and one backward on CUDA, moe.triton_swiglu)

With Transformer Engine installed on a GPU host, TE's layer spec is used instead and `experts` / `attention`
do not apply (moe.model.layer_spec).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_PATHS = ("grouped", "sequential")
ATTENTION_PATHS = ("sdpa", "local")
RECOMPUTE_MODES = ("none", "selective", "full")
DISPATCHERS = ("fast", "megatron")
EXPERT_WGRAD = ("auto", "add", "foreach", "addmm", "triton")  # moe.experts.WGRAD_ACCUMULATIONS
EXPERT_ACTIVATIONS = ("torch", "fused")  # moe.experts.GroupedGemmExperts(activation=)


class ImplementationError(ValueError):
    """An implementation choice is not one of the valid names, or cannot run this model; names the key."""


@dataclass(frozen=True)
class ModelImplementation:
    experts: str = "grouped"
    attention: str = "sdpa"
    recompute: str = "none"
    dispatcher: str = "fast"
    # how the grouped experts' weight gradients reach DDP's fp32 main_grad (moe.experts.WGRAD_ACCUMULATIONS):
    # a benchmark switch, every mode computes the same gradient
    expert_wgrad: str = "auto"
    # the grouped experts' SwiGLU x routing probability: Megatron's unfused torch ops, or one Triton kernel each
    # way (moe.triton_swiglu; the CPU runs its torch reference); a benchmark switch, both compute the same
    expert_activation: str = "torch"

    def __post_init__(self) -> None:
        for key, value, valid in (("experts", self.experts, EXPERT_PATHS),
                                  ("attention", self.attention, ATTENTION_PATHS),
                                  ("recompute", self.recompute, RECOMPUTE_MODES),
                                  ("dispatcher", self.dispatcher, DISPATCHERS),
                                  ("expert_wgrad", self.expert_wgrad, EXPERT_WGRAD),
                                  ("expert_activation", self.expert_activation, EXPERT_ACTIVATIONS)):
            if value not in valid:
                raise ImplementationError(f"model.{key} must be one of {', '.join(valid)}; got {value!r}")

    def transformer_settings(self) -> dict:
        """Megatron TransformerConfig fields for `recompute`."""
        if self.recompute == "selective":
            return dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
        if self.recompute == "full":
            return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return dict(recompute_granularity=None)
