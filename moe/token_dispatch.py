"""Megatron's all-to-all token dispatcher without two copies that cost it time and change nothing.

Shape legend: N tokens of this rank before routing, k = moe_router_topk, P = N k routed token copies (sorted by
expert), H hidden.

`MoEAlltoAllTokenDispatcher` (megatron-core 0.16.1, no Transformer Engine, so no fused permutation) spends, per
MoE layer and micro-batch, two pure-overhead passes over every routed token copy (measured on an H200 with
`benchmarks/bench_train_step.py --profile`, 4 layers of Qwen3-30B-A3B width, 2 x 4,096 tokens, k = 8):

- `sort_chunks_by_idxs` ("permutation 2", and its inverse before the combine) splits the tokens into
  (TP x EP) x E_local chunks and concatenates them in local-expert order. With TP x EP = 1 the order is the
  identity, yet `torch.cat` copies all P x H values forward and backward: 21.7 ms of a 4-micro-batch step.
  Here an identity order returns its input: same values, no copy.
- Summing each token's k routed copies runs as atomic adds of P x H values on CUDA, in no fixed order, twice:
  `unpermute` (the combine, `scatter_add_`) and the backward of `permute` (permutation 1 is an
  `index_select`, whose backward is an `index_add_`): 17.4 ms of the same step for the latter alone. When no
  token was dropped (no capacity factor: every token has exactly k copies) the copies of token n are at fixed
  positions, so both sums are a gather of them in ascending position order and one reduction over k
  (`_SumRoutedCopies` forward, `_RoutedCopiesOf` backward): no atomics, deterministic on CUDA too; the
  reduction accumulates in float32 and rounds once. On the CPU, in float32, values and gradients equal
  Megatron's bit for bit (the reduction adds the k copies in the order scatter_add / index_add do; tested).

Everything else (communication, sync points, the allgather and flex dispatchers, token dropping, fused
permutation with Transformer Engine) is Megatron's own. `FastDispatchMoELayer` is Megatron's MoELayer with
this dispatcher in place of `MoEAlltoAllTokenDispatcher`; `moe.model.layer_spec` puts it in the local spec.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


def chunk_order_is_identity(sorted_idxs: torch.Tensor) -> bool:
    """True when `sorted_idxs` (a chunk order held on the host, as Megatron keeps it without fused
    permutation) lists 0, 1, 2, ... in order. A device tensor is never inspected (that would synchronise)."""
    if sorted_idxs.device.type != "cpu":
        return False
    return bool(torch.equal(sorted_idxs, torch.arange(sorted_idxs.numel(), dtype=sorted_idxs.dtype)))


class _RoutedCopiesOf(torch.autograd.Function):
    """Megatron's permutation 1 (`tokens.index_select(0, token_of_copy_P)`, computed by Megatron on detached
    tokens) given the gradient path of a gather: d tokens_NH = the sum of each token's k copies' gradients
    (`_SumRoutedCopies`' forward) instead of index_select's backward, an atomic index_add over P x H values."""

    @staticmethod
    def forward(ctx, tokens, permuted_PH, copy_positions_Nk):
        ctx.save_for_backward(copy_positions_Nk)
        ctx.tokens_shape = tokens.shape
        return permuted_PH.view_as(permuted_PH)

    @staticmethod
    def backward(ctx, grad_permuted_PH):
        (copy_positions_Nk,) = ctx.saved_tensors
        return _gather_and_sum(grad_permuted_PH, copy_positions_Nk).view(ctx.tokens_shape), None, None


def _gather_and_sum(permuted_PH, copy_positions_Nk):
    num_tokens, topk = copy_positions_Nk.shape
    return permuted_PH.index_select(0, copy_positions_Nk.reshape(-1)).view(num_tokens, topk, -1).sum(dim=1)


def copy_positions(token_of_copy_P: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """[num_tokens, topk]: the positions of each token's copies, ascending (the order scatter_add adds them
    in), from Megatron's token-of-each-copy map; ValueError unless every token has exactly `topk` copies by
    count (the callers only use it where routing keeps all top-k experts of every token)."""
    if token_of_copy_P.shape != (num_tokens * topk,):
        raise ValueError(f"sum_routed_copies: {token_of_copy_P.numel()} routed copies for {num_tokens} tokens at "
                         f"top-{topk} (a token was dropped?)")
    return torch.argsort(token_of_copy_P, stable=True).view(num_tokens, topk)


class _SumRoutedCopies(torch.autograd.Function):
    """out_NH[n] = sum over the k copies of token n in `permuted_PH`, in ascending position order.

    copy_positions_Nk[n] are the positions of token n's copies, ascending; token_of_copy_P[p] is the token of
    position p (Megatron's `reversed_local_input_permutation_mapping`)."""

    @staticmethod
    def forward(ctx, permuted_PH, copy_positions_Nk, token_of_copy_P):
        ctx.save_for_backward(token_of_copy_P)
        return _gather_and_sum(permuted_PH, copy_positions_Nk)

    @staticmethod
    def backward(ctx, grad_out_NH):
        (token_of_copy_P,) = ctx.saved_tensors
        return grad_out_NH.index_select(0, token_of_copy_P), None, None


def sum_routed_copies(permuted_PH: torch.Tensor, token_of_copy_P: torch.Tensor, num_tokens: int,
                      topk: int, copy_positions_Nk: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron's `unpermute` (no probabilities, no drop-and-pad) when every token has exactly `topk` copies:
    [num_tokens, H], each token's copies summed. Raises ValueError when the row count says otherwise.
    copy_positions_Nk: `copy_positions(token_of_copy_P, num_tokens, topk)` when the caller has it already."""
    if permuted_PH.shape[0] != num_tokens * topk:
        raise ValueError(f"sum_routed_copies: {permuted_PH.shape[0]} routed copies for {num_tokens} tokens at "
                         f"top-{topk} (a token was dropped?)")
    if copy_positions_Nk is None:
        copy_positions_Nk = copy_positions(token_of_copy_P, num_tokens, topk)
    return _SumRoutedCopies.apply(permuted_PH, copy_positions_Nk, token_of_copy_P)


class FastAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher with the two copies of the module docstring skipped where they are
    no-ops or replaceable exactly; every other case is Megatron's own method."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TP = 1 (no sequence-parallel gather) and local-expert chunks already in order: Megatron's
        # "permutation 2" and its inverse are copies of their input (fixed at construction)
        self._skip_chunk_sort = (self.num_local_experts > 1 and self.tp_size == 1 and not self.drop_and_pad
                                 and not self.config.moe_permute_fusion
                                 and chunk_order_is_identity(self.sort_input_by_local_experts)
                                 and chunk_order_is_identity(self.restore_output_by_local_experts))

    def _chunk_sort_is_identity(self) -> bool:
        return self._skip_chunk_sort and self.shared_experts is None  # shared experts may be set later

    def _every_token_has_topk_copies(self) -> bool:
        # no capacity factor (and no padding of the routing map): routing keeps all top-k experts of every
        # token, replayed routes included
        return (self.config.moe_expert_capacity_factor is None and not self.drop_and_pad
                and not self.config.moe_permute_fusion and not self.config.moe_router_padding_for_quantization)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self._copy_positions_Nk = None
        if self.shared_experts is not None or not self._every_token_has_topk_copies():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # Megatron's permutation on the detached tokens; the gradient path to the tokens is the gather-sum
        tokens_PH, probs_P = super().dispatch_preprocess(hidden_states.detach(), routing_map, probs)
        token_of_copy_P = self.reversed_local_input_permutation_mapping
        self._copy_positions_Nk = copy_positions(token_of_copy_P, self.hidden_shape_before_permute[0],
                                                 self.config.moe_router_topk)
        if hidden_states.requires_grad:
            tokens_PH = _RoutedCopiesOf.apply(hidden_states, tokens_PH, self._copy_positions_Nk)
        return tokens_PH, probs_P

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self._chunk_sort_is_identity():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        # Megatron's method at TP = 1 less the identity sort: its host sync points, in its order
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self._chunk_sort_is_identity():
            return super().combine_preprocess(hidden_states)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens):
        if getattr(self, "_copy_positions_Nk", None) is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        output = sum_routed_copies(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
                                   self.hidden_shape_before_permute[0], self.config.moe_router_topk,
                                   self._copy_positions_Nk)
        self._copy_positions_Nk = None
        return output.view(self.hidden_shape)


class FastDispatchMoELayer(MoELayer):
    """Megatron's MoELayer, with `FastAlltoAllTokenDispatcher` where Megatron builds its all-to-all one."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            self.token_dispatcher = FastAlltoAllTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config,
                pg_collection=pg_collection)
