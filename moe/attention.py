"""Core attention on torch's scaled_dot_product_attention, for Megatron's local layer spec.

Shape legend (docs/architecture.md, plus attention's own axes): S sequence length (Sq queries, Sk keys), B batch
rows; here N is query heads and G key/value heads (per TP rank), D head dim.

`SDPACoreAttention` takes Megatron's core-attention call (q [Sq, B, N, D], k / v [Sk, B, G, D], a bool mask
that is True where attention is masked out) and returns [Sq, B, N*D] like DotProductAttention. On CUDA, SDPA
picks flash attention (no [B, N, Sq, Sk] scores in memory) and reads grouped k / v without repeating them
(`enable_gqa`). Flash attention needs `is_causal` and no explicit mask, so the causal mask is best not passed
at all: with `attention_mask=None` a causal layer runs `is_causal=True` (see moe.model.attention_mask_for).
An explicit mask (padding, any pattern) is honoured exactly, through SDPA's memory-efficient or math kernel.

Packed sequences (THD with cu_seqlens, Megatron's PackedSeqParams) are not supported: torch 2.13's
`torch.nn.attention.varlen.varlen_attn` calls flash-attention kernels that exist only on CUDA, so on the
CPU that every test runs on it could not be checked against this module; such a call raises.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from moe.implementation import ImplementationError


class SDPACoreAttention(MegatronModule):
    """Drop-in for Megatron's DotProductAttention (`SelfAttentionSubmodules.core_attention`) on torch SDPA."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        unsupported = {
            "context_parallel_size > 1": config.context_parallel_size != 1,
            "apply_query_key_layer_scaling": bool(config.apply_query_key_layer_scaling),
            "window_size": config.window_size is not None,
            f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
        }
        for what, on in unsupported.items():
            if on:
                raise ImplementationError(f"model.attention=sdpa does not support {what}; use model.attention=local")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("model.attention=sdpa: packed sequences (THD, cu_seqlens) are not "
                                      "supported; pass a padded [S, B] batch")
        if attention_bias is not None:
            raise NotImplementedError("model.attention=sdpa: attention_bias is not supported")
        mask_type = attn_mask_type or self.attn_mask_type
        q_BNSD = query.permute(1, 2, 0, 3)
        k_BGSD = key.permute(1, 2, 0, 3)
        v_BGSD = value.permute(1, 2, 0, 3)
        if attention_mask is None:
            if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
                raise ValueError(f"SDPACoreAttention: attn_mask_type {mask_type} needs an explicit attention_mask")
            allowed, is_causal = None, mask_type == AttnMaskType.causal
        else:
            # Megatron's mask is True where masked out; SDPA's bool mask is True where attention is allowed
            allowed, is_causal = ~attention_mask.bool(), False
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BGSD, v_BGSD, attn_mask=allowed, is_causal=is_causal,
            dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=self.num_heads_per_partition != self.num_groups_per_partition)
        seq, batch = query.shape[0], query.shape[1]
        return out_BNSD.permute(2, 0, 1, 3).reshape(seq, batch, self.num_heads_per_partition * query.shape[3])
