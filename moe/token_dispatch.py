"""Megatron's all-to-all token dispatcher without two copies that cost it time and change nothing, and, at
EP = TP = 1, without a host synchronisation.

Shape legend: N tokens of this rank before routing, k = moe_router_topk, P = N k routed token copies (sorted by
expert), H hidden, E experts (all of them local at EP = 1), X = E N (expert, token) pairs in expert-major order.

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

At EP = TP = 1 Megatron's dispatcher also makes the host wait for the device in every MoE layer forward:
`moe_utils.permute` (unfused) runs `masked_select` twice (an output size read from the device) and
`_maybe_dtoh_and_synchronize` copies the counts per expert to the host and waits for them ("before_permutation_2"
/ "before_finish"), so the host cannot queue the experts' kernels ahead of the device (an H100 profile of a step
had the device busy 47% of its wall time). Without dropped tokens every token has exactly k copies, so P = N k
is known on the host: `expert_major_permutation` computes Megatron's order (experts ascending, tokens ascending
within an expert) from one cumulative sum and one scatter over the X pairs, and the counts per expert stay on
the device, handed to experts that take them there (`GroupedGemmExperts` with no per-expert host slicing):
no host read at all (the one check, that the map holds N k copies, is a device-side assert).
tests/test_moe_host_sync.py checks forward and backward with a dispatch-mode detector on the CPU and under
`torch.cuda.set_sync_debug_mode("error")` on CUDA. Tokens, probabilities, the token-of-copy map, the counts,
and a whole layer's outputs and gradients equal Megatron's bit for bit on the CPU in float32.

Everything else (communication, the sync points at EP or TP > 1, the allgather and flex dispatchers, token
dropping, shared experts, experts that need host counts, fused permutation with Transformer Engine) is
Megatron's own. `FastDispatchMoELayer` is Megatron's MoELayer with this dispatcher in place of
`MoEAlltoAllTokenDispatcher` (overlapped shared experts handed on to it); `moe.model.layer_spec` puts it in the
local spec.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from moe.experts import GroupedGemmExperts


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


def expert_major_permutation(routing_NE: torch.Tensor, probs_NE: torch.Tensor, topk: int):
    """Megatron's `permute` (unfused, no drop-and-pad) order of the routed copies without reading anything on
    the host, for a routing map in which every token has exactly `topk` experts (P = N k, a static size).
    -> (token_of_copy_P: Megatron's `reversed_local_input_permutation_mapping`, probs_P: its permuted probs,
    copy_positions_Nk: the positions of each token's copies, ascending, as `copy_positions` gives them).

    Megatron's order is `masked_select` over routing_map.T: the X (expert, token) pairs in expert-major order,
    the routed ones kept. The same order as a stable partition of the pairs, routed first: a routed pair goes to
    the count of routed pairs before it, an unrouted one to P + the count of unrouted pairs before it. That is a
    permutation of 0..X-1, so one scatter with distinct targets inverts it (no atomics, no duplicate writes),
    and no step has a size that depends on device values."""
    num_tokens, num_experts = routing_NE.shape
    num_copies = num_tokens * topk
    device = routing_NE.device
    routed_X = routing_NE.T.reshape(-1)
    routed_through_X = torch.cumsum(routed_X, 0)  # routed pairs up to and including this one (int64)
    if routed_X.numel():
        # the caller's promise (topk copies per token) checked on the device: a kernel, not a host read
        torch._assert_async(routed_through_X[-1] == num_copies,
                            "expert_major_permutation: the routing map does not hold topk experts per token")
    pair_X = torch.arange(routed_X.numel(), device=device)
    slot_X = torch.where(routed_X, routed_through_X - 1, num_copies + pair_X - routed_through_X)
    pair_P = torch.empty_like(pair_X).scatter_(0, slot_X, pair_X)[:num_copies]
    token_of_copy_P = torch.remainder(pair_P, num_tokens)
    expert_of_copy_P = torch.div(pair_P, num_tokens, rounding_mode="floor")
    pair_in_NE_P = token_of_copy_P * num_experts + expert_of_copy_P  # (n, e) in the router's [N, E] layout
    probs_P = probs_NE.reshape(-1).index_select(0, pair_in_NE_P)
    # a token's copies in ascending position = its experts in ascending order: copy j of token n is the one
    # whose expert is the token's j-th (the count of its routed experts up to this one, less one)
    rank_NE = torch.cumsum(routing_NE, 1) - 1
    copy_of_token_P = token_of_copy_P * topk + rank_NE.reshape(-1).index_select(0, pair_in_NE_P)
    positions_P = torch.arange(num_copies, device=device)
    copy_positions_Nk = torch.empty_like(positions_P).scatter_(0, copy_of_token_P, positions_P)
    return token_of_copy_P, probs_P, copy_positions_Nk.view(num_tokens, topk)


def experts_take_device_counts(experts) -> bool:
    """True when `experts` reads the token counts per expert only on the device: `GroupedGemmExperts` turns them
    into grouped_mm offsets there, except with `addmm` weight-gradient accumulation (per-expert GEMMs sliced
    on the host). Megatron's SequentialMLP / TE experts call `.tolist()` on them: host counts."""
    return isinstance(experts, GroupedGemmExperts) and experts.wgrad_accumulation != "addmm"


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
        # EP = TP = 1: no communication needs split sizes, so nothing has to reach the host (the chunk sort is
        # the identity); the device-to-host point must be Megatron's default (CUDA graphs move it to the
        # all-to-all, where Megatron would copy the counts to the host anyway)
        self._single_rank = (self.ep_size == 1 and self.tp_size == 1
                             and self.cuda_dtoh_point == "before_permutation_1")
        # set by FastDispatchMoELayer once its experts exist (`experts_take_device_counts`)
        self.experts_take_device_counts = False
        self._counts_on_device = False

    def _chunk_sort_is_identity(self) -> bool:
        return self._skip_chunk_sort and self.shared_experts is None  # shared experts may be set later

    def _every_token_has_topk_copies(self) -> bool:
        # no capacity factor (and no padding of the routing map): routing keeps all top-k experts of every
        # token, replayed routes included
        return (self.config.moe_expert_capacity_factor is None and not self.drop_and_pad
                and not self.config.moe_permute_fusion and not self.config.moe_router_padding_for_quantization)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self._copy_positions_Nk = None
        self._counts_on_device = False
        if self.shared_experts is not None or not self._every_token_has_topk_copies():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        if self._single_rank and self.experts_take_device_counts:
            return self._dispatch_preprocess_on_device(hidden_states, routing_map, probs)
        # Megatron's permutation on the detached tokens; the gradient path to the tokens is the gather-sum
        tokens_PH, probs_P = super().dispatch_preprocess(hidden_states.detach(), routing_map, probs)
        token_of_copy_P = self.reversed_local_input_permutation_mapping
        self._copy_positions_Nk = copy_positions(token_of_copy_P, self.hidden_shape_before_permute[0],
                                                 self.config.moe_router_topk)
        if hidden_states.requires_grad:
            tokens_PH = _RoutedCopiesOf.apply(hidden_states, tokens_PH, self._copy_positions_Nk)
        return tokens_PH, probs_P

    def _dispatch_preprocess_on_device(self, hidden_states, routing_map, probs):
        """Megatron's `dispatch_preprocess` at EP = TP = 1 with the permutation of `expert_major_permutation`:
        the same tokens, probs and token-of-copy map, no host read. Megatron's `preprocess` still runs for
        its bookkeeping (counts per expert, on the device; num_out_tokens = N k); the host sync points it
        picks are never reached on this path."""
        assert probs.dim() == 2 and routing_map.dim() == 2 and routing_map.dtype == torch.bool
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        tokens_NH = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = tokens_NH.shape
        self.tokens_per_expert = self.preprocess(routing_map)
        token_of_copy_P, probs_P, self._copy_positions_Nk = expert_major_permutation(
            routing_map, probs, self.config.moe_router_topk)
        self.reversed_local_input_permutation_mapping = token_of_copy_P
        self._counts_on_device = True
        # permutation 1 on the detached tokens; the gradient path to the tokens is the gather-sum
        tokens_PH = tokens_NH.detach().index_select(0, token_of_copy_P)
        if hidden_states.requires_grad:
            tokens_PH = _RoutedCopiesOf.apply(hidden_states, tokens_PH, self._copy_positions_Nk)
        return tokens_PH, probs_P

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if self._counts_on_device:
            # EP = TP = 1: nothing was exchanged and the chunk order is the identity; the counts stay on the
            # device for the experts (Megatron would copy them to the host and wait for them here)
            tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
            return global_input_tokens, tokens_per_expert, global_probs
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
            self.token_dispatcher.experts_take_device_counts = experts_take_device_counts(self.experts)
            if self.use_shared_expert and self.shared_expert_overlap:
                # MoELayer handed its overlapped shared experts to the dispatcher it built and replaced here
                self.token_dispatcher.set_shared_experts(self.shared_experts)
