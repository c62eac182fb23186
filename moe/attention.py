"""Core attention on torch's scaled_dot_product_attention, for Megatron's local layer spec.

Shape legend (docs/architecture.md, plus attention's own axes): S sequence length (Sq queries, Sk keys), B batch
rows; here N is query heads and G key/value heads (per TP rank), D head dim.

`SDPACoreAttention` takes Megatron's core-attention call (q [Sq, B, N, D], k / v [Sk, B, G, D], a bool mask
that is True where attention is masked out) and returns [Sq, B, N*D] like DotProductAttention. On CUDA, SDPA
picks flash attention (no [B, N, Sq, Sk] scores in memory) and reads grouped k / v without repeating them
(`enable_gqa`). Flash attention needs `is_causal` and no explicit mask, so the causal mask is best not passed
at all: with `attention_mask=None` a causal layer runs `is_causal=True` (see moe.model.attention_mask_for).
An explicit mask (padding, any pattern) is honoured exactly, through SDPA's memory-efficient or math kernel.

Packed sequences (THD: Megatron's PackedSeqParams with qkv_format "thd"; q [T, N, D], k / v [T, G, D], the
sequences' offsets in cu_seqlens): each sequence attends causally to itself only, never to its neighbours in
the stream. On CUDA with bf16 / fp16 one call of torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, window (-1, 0) = causal, through moe.cuda_calls, which passes the
grouped key/value heads in the form the installed torch takes) covers the whole stream; elsewhere (the CPU,
or fp32, which flash attention does not take) the same module runs causal SDPA per sequence, the sequences of
one length batched into one call, which computes the same function (tests/test_moe_packed_attention.py: values and gradients against the padded batch).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from moe import cuda_calls
from moe.implementation import ImplementationError

log = logging.getLogger(__name__)
_LOGGED_PER_SEQUENCE = []


def varlen_available() -> bool:
    """Whether this torch build has variable-length flash attention (torch >= 2.11: torch.nn.attention.varlen)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


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
        if attention_bias is not None:
            raise NotImplementedError("model.attention=sdpa: attention_bias is not supported")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params)
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

    def _forward_packed(self, q_TND, k_TGD, v_TGD, params):
        """THD input (Megatron squeezes the batch axis of a packed [T, 1, ...] stream) -> [T, N*D]; every
        sequence of cu_seqlens attends causally within itself."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"model.attention=sdpa: packed qkv_format {params.qkv_format!r}; only 'thd'")
        if self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("model.attention=sdpa: packed sequences need causal attention")
        if self.training and self.dropout_p:
            raise NotImplementedError("model.attention=sdpa: attention dropout with packed sequences")
        cu_N1 = params.cu_seqlens_q
        if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not cu_N1 \
                and not torch.equal(params.cu_seqlens_kv, cu_N1):
            raise NotImplementedError("model.attention=sdpa: packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        gqa = self.num_heads_per_partition != self.num_groups_per_partition
        if q_TND.is_cuda and q_TND.dtype in (torch.bfloat16, torch.float16) and varlen_available():
            # flash kernels want each head's D contiguous; Megatron's split of the fused QKV leaves v a strided view
            q_TND, k_TGD, v_TGD = (x.contiguous() for x in (q_TND, k_TGD, v_TGD))
            out_TND = cuda_calls.varlen_attn(q_TND, k_TGD, v_TGD, cu_N1, params.max_seqlen_q,
                                             scale=self.softmax_scale)
        else:
            if not _LOGGED_PER_SEQUENCE:
                log.info("model.attention=sdpa: packed sequences on %s / %s run SDPA per sequence (batched by length) "
                         "(variable-length flash attention needs CUDA and bf16 / fp16)", q_TND.device, q_TND.dtype)
                _LOGGED_PER_SEQUENCE.append(True)
            out_TND = self._per_sequence(q_TND, k_TGD, v_TGD, cu_N1.tolist(), gqa)
        return out_TND.reshape(q_TND.shape[0], self.num_heads_per_partition * q_TND.shape[2])

    def _per_sequence(self, q_TND, k_TGD, v_TGD, offsets: list, gqa: bool):
        """Causal SDPA within each sequence, the sequences of one length batched into one call ([n, N, L, D]):
        RL micro-batches hold many sequences of a few lengths (short answers) or few long ones, so this is a
        handful of calls either way instead of one per sequence."""
        if offsets[-1] != q_TND.shape[0]:
            raise ValueError(f"packed attention: cu_seqlens ends at {offsets[-1]} but the stream holds "
                             f"{q_TND.shape[0]} tokens")
        starts_by_length: dict = {}
        for start, end in zip(offsets[:-1], offsets[1:]):
            if end > start:
                starts_by_length.setdefault(end - start, []).append(start)
        device = q_TND.device
        pieces, positions = [], []
        for length, starts in starts_by_length.items():
            index_nL = (torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)[None])
            flat = index_nL.reshape(-1)
            q_nNLD, k_nGLD, v_nGLD = (x[flat].view(len(starts), length, *x.shape[1:]).transpose(1, 2)
                                      for x in (q_TND, k_TGD, v_TGD))
            out_nNLD = F.scaled_dot_product_attention(q_nNLD, k_nGLD, v_nGLD, is_causal=True,
                                                      scale=self.softmax_scale, enable_gqa=gqa)
            pieces.append(out_nNLD.transpose(1, 2).reshape(-1, *q_TND.shape[1:]))
            positions.append(flat)
        gathered_TND = torch.cat(pieces)
        # back to stream order: the piece rows sit at `positions`; invert that permutation
        return gathered_TND[torch.argsort(torch.cat(positions))]
