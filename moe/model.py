"""Build a Megatron-Core GPTModel for the Qwen3-MoE architecture, and run its forward pass.

Shape legend: B batch, S sequence length, V vocabulary (V/TP per rank with tensor parallelism), H hidden.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from moe.architecture import Qwen3MoeArchitecture, transformer_config
from moe import cuda_calls
from moe.attention import SDPACoreAttention
from moe.cpu_shim import is_applied, tensor_cuda_as_identity
from moe.device import use_cuda
from moe.experts import GroupedGemmExperts
from moe.implementation import ModelImplementation
from moe.megatron_compat import apply_megatron_compat
from moe.parallel import ParallelLayout
from moe.sharding import is_expert_param
from moe.token_dispatch import FastDispatchMoELayer


def transformer_engine_available() -> bool:
    """True when TE imports cleanly (a GPU host); a broken TE install raises, it is not hidden."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(config, use_transformer_engine: bool | None = None,
               implementation: ModelImplementation = ModelImplementation()):
    """Layer specs per decoder layer: Transformer Engine's when TE is available on a GPU host; otherwise
    Megatron's local (torch) spec with the experts, core attention and token dispatcher that `implementation`
    names."""
    if use_transformer_engine is None:
        use_transformer_engine = use_cuda() and transformer_engine_available()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine,
                                      normalization="RMSNorm")
    if use_transformer_engine:
        logging.getLogger(__name__).info(
            "layer spec: Transformer Engine's (model.experts=%s / model.attention=%s apply to the local spec only)",
            implementation.experts, implementation.attention)
        return spec
    # Megatron builds these specs from module-level objects: edit a copy, never the shared ones.
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs:
        if implementation.attention == "sdpa":
                    layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        mlp = layer.submodules.mlp
        if implementation.dispatcher == "fast" and getattr(mlp.submodules, "experts", None) is not None:
            if mlp.module not in (MoELayer, FastDispatchMoELayer):
                raise RuntimeError(f"layer_spec: expected Megatron's MoELayer, found {mlp.module}")
            mlp.module = FastDispatchMoELayer
        if implementation.experts == "grouped" and getattr(mlp.submodules, "experts", None) is not None:
            # layers share spec objects (the copy keeps that aliasing): a shared one is already replaced
            if mlp.submodules.experts.module not in (SequentialMLP, GroupedGemmExperts):
                raise RuntimeError(f"layer_spec: expected Megatron's local SequentialMLP experts, found "
                                   f"{mlp.submodules.experts.module}")
            mlp.submodules.experts.module = GroupedGemmExperts
            mlp.submodules.experts.params = {**mlp.submodules.experts.params,
                                             "wgrad_accumulation": implementation.expert_wgrad,
                                             "activation": implementation.expert_activation}
    return spec


def build_model(
    arch: Qwen3MoeArchitecture,
    layout: ParallelLayout = ParallelLayout(),
    *,
    token_dispatcher: str = "alltoall",
    params_dtype: torch.dtype = torch.float32,
    routing_replay: bool = False,
    use_transformer_engine: bool | None = None,
    implementation: ModelImplementation = ModelImplementation(),
    **config_overrides,
):
    """A GPTModel for this rank of `layout`; model-parallel groups must already exist.

    implementation: experts / core attention / activation recompute (moe.implementation); every choice
    computes the same function and keeps the same parameter names."""
    layout.check_model(arch.num_hidden_layers, arch.num_experts, arch.num_attention_heads,
                       arch.num_key_value_heads, arch.vocab_size)
    cpu = not use_cuda()
    if cpu:
        if not is_applied():
            raise RuntimeError("build_model on a host without CUDA: call moe.cpu_shim.apply_cpu_shim() first")
    apply_megatron_compat()  # megatron-core 0.16.1 without TE: te_general_gemm (CPU and GPU alike)
    config = transformer_config(
        arch,
        tensor_parallel=layout.tensor_parallel,
        expert_parallel=layout.expert_parallel,
        pipeline_parallel=layout.pipeline_parallel,
        expert_tensor_parallel=layout.expert_tensor_parallel,
        token_dispatcher=token_dispatcher,
        params_dtype=params_dtype,
        cpu=cpu,
        routing_replay=routing_replay,
        recompute=implementation.recompute,
        **config_overrides,
    )
    # With tie_word_embeddings and PP > 1 the last stage holds a copy of the embedding as output_layer.weight,
    # made equal to the first stage's by Megatron (an all-reduce over the embedding group that first moves it
    # with .cuda(): kept on the CPU here) and kept equal by finalize_model_grads (moe.optimizer.finish_gradients).
    construct = contextlib.nullcontext()
    if cpu and arch.tie_word_embeddings and layout.pipeline_parallel > 1:
        construct = tensor_cuda_as_identity()
    with construct:
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, use_transformer_engine, implementation),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        )
    _mark_expert_parameters(model)
    if not cpu:
        model = place_on_gpu(model)
    return model


def set_router_aux_loss_coef(model, coef: float) -> float:
    """Every router's load-balancing (aux) loss coefficient from now on (Megatron reads its config's
    moe_aux_loss_coeff at each forward, and the model's layers share one TransformerConfig): the RL phase's own,
    where it differs from the one the model was built with (the cold start's). A model built without the aux
    loss (coefficient 0: its routers' load balancing "none") gets it switched on. -> the coefficient before."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError("set_router_aux_loss_coef: the model has no MoE router")
    before = float(routers[0].config.moe_aux_loss_coeff)
    for router in routers:
        router.config.moe_aux_loss_coeff = float(coef)
        if coef > 0 and router.routing_type == "none":
            router.routing_type = "aux_loss"
            router.config.moe_router_load_balancing_type = "aux_loss"
    return before


def place_on_gpu(model):
    """The built model moved to this process's GPU (Megatron builds it on the host without TE's init)."""
    return cuda_calls.module_to_cuda(model, cuda_calls.current_cuda_device())


def _mark_expert_parameters(model) -> None:
    """Every expert weight gets Megatron's `allreduce = False` (Megatron's layers set it only when EP > 1), so
    Megatron's DDP and optimizer treat experts as expert-parallel at every layout: their gradients are summed
    over the expert-data-parallel group. At EP = 1 with TP > 1 (expert-TP 1) each TP rank's full expert copy
    sees only its sequence-parallel chunk of the tokens, so without this the dense data-parallel group (one
    rank) would leave the TP ranks' partial expert gradients unsummed."""
    for name, param in model.named_parameters():
        if is_expert_param(name):
            param.allreduce = False


def causal_attention_mask(seq_len: int, device=None) -> torch.Tensor:
    """[1, 1, S, S] bool, True where attention is masked out (Megatron's convention).

    Passed explicitly because Megatron's default mask is built on "cuda".
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def attention_mask_for(model, seq_len: int, device=None) -> torch.Tensor | None:
    """The attention_mask to pass `model` for causal sequences: None when every layer's core attention is
    SDPA (it runs `is_causal=True`, which lets flash attention run; an explicit mask would rule it out),
    else `causal_attention_mask` (Megatron's DotProductAttention builds its default mask on "cuda")."""
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", None) or [])
    if layers and all(isinstance(layer.self_attention.core_attention, SDPACoreAttention) for layer in layers):
        return None
    return causal_attention_mask(seq_len, device=device)


@dataclass(frozen=True)
class PackedSequences:
    """Where the sequences of a packed model input [1, T] start and end (the THD layout): sequence i holds
    stream positions [cu_seqlens_N1[i], cu_seqlens_N1[i+1]); N sequences, cu_seqlens_N1[-1] == T. Every
    sequence attends only to itself and its positions (RoPE) restart at 0."""

    cu_seqlens_N1: torch.Tensor   # int32, on the model's device
    max_seqlen: int
    num_tokens: int               # T = cu_seqlens_N1[-1], kept on the host (reading it back would sync a GPU)

    @classmethod
    def from_lengths(cls, lengths: list, device=None) -> "PackedSequences":
        if not lengths or any(int(n) < 1 for n in lengths):
            raise ValueError(f"PackedSequences: every sequence needs at least one token, got lengths {lengths}")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + int(n))
        return cls(torch.tensor(offsets, dtype=torch.int32, device=device), max(int(n) for n in lengths), offsets[-1])

    def position_ids_1T(self) -> torch.Tensor:
        """Each token's position within its own sequence, [1, T]."""
        cu = self.cu_seqlens_N1.long()
        lengths_N = cu[1:] - cu[:-1]
        starts_T = torch.repeat_interleave(cu[:-1], lengths_N, output_size=self.num_tokens)
        return (torch.arange(self.num_tokens, device=cu.device) - starts_T)[None]

    def megatron_params(self) -> PackedSeqParams:
        """Megatron-Core's description of the same layout (RoPE per sequence, THD core attention)."""
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens_N1, cu_seqlens_kv=self.cu_seqlens_N1,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def check_packed_support(model) -> None:
    """Packed input needs a core attention that reads cu_seqlens: SDPACoreAttention (model.attention=sdpa) or
    Transformer Engine's. Megatron's local DotProductAttention would fail on it with an assertion."""
    decoder = getattr(model, "decoder", None)
    for layer in list(getattr(decoder, "layers", None) or []):
        core = layer.self_attention.core_attention
        if not isinstance(core, SDPACoreAttention) and not type(core).__module__.startswith("megatron.core.extensions"):
            raise ValueError(f"packed sequences need model.attention=sdpa (or Transformer Engine); this model's "
                             f"core attention is {type(core).__name__}: set rl.batch.packing=false or model.attention=sdpa")


def forward_logits(model, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None,
                   padding_mask_BS: torch.Tensor | None = None, packed: PackedSequences | None = None) -> torch.Tensor:
    """Logits [B, S, V/TP] (vocab-parallel shard: this TP rank's vocab ids [r*V/TP, (r+1)*V/TP)) of a padded
    batch of causal sequences, or of one packed stream (`packed`: B = 1, S = T; no position is padding except
    what the caller marks). With sequence parallelism (TP > 1) S must be a multiple of TP.

    padding_mask_BS: bool, True at padding positions (Megatron's code convention, despite its docstrings):
    left out of the router's load-balancing / z losses (routing and logits are computed as without it)."""
    batch, seq_len = input_ids_BS.shape
    config = getattr(model, "config", None)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if getattr(config, "sequence_parallel", False) and seq_len % tp:
        raise ValueError(f"forward_logits: sequence length {seq_len} is not a multiple of tensor_parallel={tp} "
                         "(sequence parallelism splits the sequence over TP ranks); right-pad the batch")
    extra = {}
    if packed is not None:
        if batch != 1 or packed.num_tokens != seq_len:
            raise ValueError(f"forward_logits: a packed input is [1, T] with T = cu_seqlens[-1] = {packed.num_tokens}; "
                             f"got {tuple(input_ids_BS.shape)}")
        if position_ids_BS is None:
            position_ids_BS = packed.position_ids_1T()
        mask, extra["packed_seq_params"] = None, packed.megatron_params()
    else:
        mask = attention_mask_for(model, seq_len, device=input_ids_BS.device)
    if position_ids_BS is None:
        position_ids_BS = torch.arange(seq_len, device=input_ids_BS.device).expand(batch, seq_len)
    if padding_mask_BS is not None:
        extra["padding_mask"] = padding_mask_BS.bool()
    return model(input_ids=input_ids_BS, position_ids=position_ids_BS, attention_mask=mask, **extra)
