"""The Qwen3-MoE architecture as a validated dataclass, and its Megatron-Core TransformerConfig.

Field names follow Hugging Face's `Qwen3MoeConfig` so a `config.json` maps onto them one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe.cpu_shim import CPU_TRANSFORMER_SETTINGS
from moe.implementation import ModelImplementation


class ArchitectureError(ValueError):
    """An architecture field is missing, unsupported or out of range; the message names it."""


@dataclass(frozen=True)
class Qwen3MoeArchitecture:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int = 0  # dense-layer FFN width; only used by layers that are not MoE
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                    "num_experts_per_tok", "decoder_sparse_step", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ArchitectureError(f"architecture field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ArchitectureError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ArchitectureError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        for i in self.mlp_only_layers:
            if not 0 <= i < self.num_hidden_layers:
                raise ArchitectureError(
                    f"mlp_only_layers holds layer {i}, outside 0..{self.num_hidden_layers - 1}"
                )
        if any(not is_moe for is_moe in self.moe_layer_pattern) and self.intermediate_size <= 0:
            raise ArchitectureError(
                "intermediate_size must be positive: this architecture has dense layers "
                f"(mlp_only_layers={list(self.mlp_only_layers)}, decoder_sparse_step={self.decoder_sparse_step})"
            )
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            if not float(getattr(self, name)) > 0:
                raise ArchitectureError(f"architecture field {name!r} must be > 0, got {getattr(self, name)!r}")
        if self.router_aux_loss_coef < 0:
            raise ArchitectureError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, by the rule of HF's Qwen3MoeDecoderLayer."""
        return [
            int(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)
            for i in range(self.num_hidden_layers)
        ]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def transformer_config(
    arch: Qwen3MoeArchitecture,
    *,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_tensor_parallel: int = 1,
    token_dispatcher: str = "alltoall",
    params_dtype=None,
    cpu: bool = True,
    routing_replay: bool = False,
    recompute: str = "none",
    **overrides,
):
    """Megatron-Core TransformerConfig computing the same function as HF's Qwen3MoeForCausalLM.

    recompute: activation recompute, one of moe.implementation.RECOMPUTE_MODES (none | selective | full)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if token_dispatcher not in ("alltoall", "allgather"):
        raise ArchitectureError(f"token_dispatcher must be 'alltoall' or 'allgather', got {token_dispatcher!r}")
    params_dtype = params_dtype or torch.float32
    settings = dict(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size if arch.intermediate_size > 0 else arch.moe_intermediate_size,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_layer_freq=arch.moe_layer_pattern,
        # HF: softmax over all experts, top-k, then renormalise if norm_topk_prob. Megatron's
        # pre_softmax=False is top-k on logits then softmax over the k — the renormalised form.
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if arch.router_aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=arch.router_aux_loss_coef,
        moe_token_dispatcher_type=token_dispatcher,
        moe_router_dtype="fp32",
        moe_enable_routing_replay=routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        # Megatron requires SP for TP>1 MoE training (the dispatcher works on sequence-split tokens).
        sequence_parallel=tensor_parallel > 1,
        pipeline_dtype=params_dtype,
    )
    if cpu:
        settings.update(CPU_TRANSFORMER_SETTINGS)
    settings.update(ModelImplementation(recompute=recompute).transformer_settings())
    settings.update(overrides)
    return TransformerConfig(**settings)
