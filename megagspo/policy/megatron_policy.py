"""The policy on Megatron-Core: distributed set-up, model build (fp32 or bf16), token log-probs, gradients
through Megatron's DDP and updates through its distributed optimizer, full-state export for the rollout
engine (gathering TP shards and EP experts).

Log-prob paths (`logprob_path`, config model.logprob_path):
- "hidden" (default): the decoder's final hidden states and the LM head's weight (moe.output_hidden) go into
  the chunked linear log-prob kernel (megagspo.kernels.linear_token_logprobs): the [T, V/TP] logits exist
  one chunk of `logprob_chunk_tokens` tokens at a time, in forward and in backward, never whole. Gradients
  reach the LM head weight (the tied embedding or its last-stage copy) and the hidden states as on the
  logits path; d weight is added straight into Megatron DDP's fp32 gradient buffer of the weight.
- "logits": Megatron's output layer materialises [B, S, V/TP] logits, then the log-prob kernel
  (megagspo.kernels.token_logprobs) or, with logprob_impl "torch", a naive log_softmax.
Tensor parallelism: both paths stay vocab-parallel (each rank multiplies by its V/TP rows; partial max /
sum-exp all-reduced over the TP group, no [T, V] gather); the TP ranks of one data-parallel rank get
identical log-probs, losses and metrics. With sequence parallelism S must be a multiple of TP
(`seq_multiple`); the hidden path all-gathers the sequence-split hidden states as the output layer does.

Pipeline parallelism (`run_micro_batches`): with PP > 1 each rank holds a contiguous range of layers (the
embedding on the first stage, the LM head on the last) and the micro-batches go through Megatron-Core's
non-interleaved 1F1B schedule (`get_forward_backward_func`): activations and their gradients travel between
stages by p2p, only the last stage computes log-probs and the loss, and its per-micro-batch results are
returned there (None on the other stages). With PP = 1 the same call is a plain loop, unchanged.

Legend: B rows, S sequence length (model input), V vocab (V/TP local), H hidden, T = B*S tokens in storage order
(b*S + s).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from megagspo.kernels import linear_token_logprobs, token_logprobs
from moe.model import PackedSequences, build_model, check_packed_support, forward_logits, set_router_aux_loss_coef
from moe.optimizer import (build_optimizer, finish_gradients, loss_scale_for_sum, optimizer_step, params_dtype,
                           wrap_data_parallel, zero_gradients)
from moe.output_hidden import forward_hidden, output_weight, output_weight_grad_buffer
from moe.parallel import ParallelDims, setup_process_groups
from moe.pipeline import gather_vocab_shards, run_schedule, set_aux_loss_scale
from moe.routing_replay import RoutingReplay
from moe.sharding import gather_full_state_dict, load_full_state_dict


def setup_parallel(parallel_cfg, seed: int):
    """torch.distributed + Megatron's groups for the recipe's parallel.* sizes (moe.parallel.setup_process_groups).
    -> (dims, rank, world size): the run's one ParallelDims, and its global rank and world size."""
    dims = setup_process_groups(parallel_cfg.layout(), seed)
    return dims, dims.rank, dims.world_size


@dataclass
class ModelInput:
    """One micro-batch's model input: a right-padded batch [B, S], or one packed stream [1, T] of whole
    sequences (`packed`: their cu_seqlens; no position is padding except an alignment tail the caller marks).
    targets_BS[b, s] is the token that follows input_ids_BS[b, :s+1] within its sequence; padding_mask_BS is
    True at positions that are padding (left out of the router aux loss)."""

    input_ids_BS: torch.Tensor
    targets_BS: torch.Tensor
    padding_mask_BS: Optional[torch.Tensor] = None
    packed: Optional[PackedSequences] = None

    @classmethod
    def padded(cls, input_ids_BS, targets_BS, unpadded_len: Optional[int] = None) -> "ModelInput":
        """A padded batch whose positions >= unpadded_len are alignment padding (S rounded up to TP)."""
        seq_len = input_ids_BS.shape[1]
        mask = None
        if unpadded_len is not None and unpadded_len < seq_len:
            mask = (torch.arange(seq_len, device=input_ids_BS.device) >= unpadded_len).expand_as(input_ids_BS)
        return cls(input_ids_BS, targets_BS, mask)


LOGPROB_PATHS = ("hidden", "logits")
# logprob_impl (config rl.logprob_impl) -> the megagspo.kernels impl: "kernels" demands the fused kernels
# (an error where megagspo._C cannot serve the device, never a fallback)
_KERNEL_IMPL = {"auto": "auto", "kernels": "fused"}


def _logprob_fn(impl: str, tp_group=None):
    """(logits_TV, target_T) -> (logp_T, entropy_T): megagspo.kernels.token_logprobs (impl auto / kernels),
    or the naive torch path (impl torch).

    tp_group (TP > 1): logits_TV is this rank's vocab shard; the kernels combine the shards' statistics
    over the group; the naive torch path all-gathers the full [T, V] logits first (differentiably)."""
    if impl in _KERNEL_IMPL:
        return lambda logits, target: token_logprobs(logits, target, with_entropy=True, tp_group=tp_group,
                                                     impl=_KERNEL_IMPL[impl])
    if impl != "torch":
        raise ValueError(f"logprob_impl = {impl!r} is not valid; valid values: auto, kernels, torch")

    def torch_logprobs(logits_TV, target_T):
        if tp_group is not None:
            logits_TV = gather_vocab_shards(logits_TV)
        logsm_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        logp_T = logsm_TV.gather(-1, target_T[:, None]).squeeze(-1)
        entropy_T = -(logsm_TV.exp() * logsm_TV).sum(-1)
        return logp_T, entropy_T

    return torch_logprobs


def _linear_logprob_fn(impl: str, chunk_tokens: int, tp_group=None):
    """(hidden_TH, weight_VH, target_T, weight_grad_buffer) -> (logp_T, entropy_T) by the chunked linear kernel,
    vocab-parallel over tp_group (TP > 1); d weight is added into weight_grad_buffer when it is not None.
    impl "torch" is refused: it needs the whole logits."""
    if impl not in _KERNEL_IMPL:
        raise ValueError(f"logprob_path = 'hidden' computes log-probs chunk by chunk with megagspo.kernels; "
                         f"logprob_impl = {impl!r} needs the whole logits: use logprob_impl auto or kernels, or "
                         f"logprob_path = 'logits'")
    return lambda hidden, weight, target, weight_grad_buffer: linear_token_logprobs(
        hidden, weight, target, chunk_size=chunk_tokens, with_entropy=True, tp_group=tp_group,
        weight_grad_buffer=weight_grad_buffer, impl=_KERNEL_IMPL[impl])


class MegatronPolicy:
    def __init__(self, arch, dims: ParallelDims, parallel_cfg, logprob_impl: str = "auto", *, frozen: bool = False,
                 precision: str = "fp32", logprob_path: str = "hidden", logprob_chunk_tokens: int = 1024,
                 implementation=None, adamw_class: Optional[type] = None) -> None:
        """frozen=True: the KL reference policy (rl.kl.coef > 0): the same layout and log-prob path, no
        gradients, eval mode, and no routing replay (it always routes with its own router; see megagspo.rl.step).

        precision: "fp32" or "bf16" parameters (moe.optimizer.PRECISIONS). A trainable policy is wrapped in
        Megatron-Core's DistributedDataParallel (`self.ddp`: fp32 gradient buffers, bucketed reduction) and is
        updated by Megatron's distributed optimizer (`make_optimizer` / `step`); `self.model` stays the bare
        GPTModel that forwards run through.

        logprob_path: "hidden" (log-probs from the final hidden states and the LM head weight, chunks of
        `logprob_chunk_tokens` tokens) or "logits" (Megatron's output layer, then the log-prob kernel); see
        the module docstring. Checked before the model is built.

        implementation: moe.implementation.ModelImplementation (config model.experts / attention / recompute);
        None = its defaults.

        dims: the run's moe.parallel.ParallelDims (setup_parallel); the policy's sizes, ranks and groups are
        its (`self.dims`).

        adamw_class: the torch optimizer inside Megatron's distributed optimizer (moe.optimizer.build_optimizer;
        None = torch.optim.AdamW)."""
        if logprob_path not in LOGPROB_PATHS:
            raise ValueError(f"logprob_path = {logprob_path!r} is not valid; valid values: {', '.join(LOGPROB_PATHS)}")
        if isinstance(logprob_chunk_tokens, bool) or not isinstance(logprob_chunk_tokens, int) \
                or logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be a positive integer, got {logprob_chunk_tokens!r}")
        self.arch = arch
        self.frozen = frozen
        self.logprob_path = logprob_path
        self.dims = dims
        self.adamw_class = adamw_class
        self.model = build_model(arch, dims.layout, token_dispatcher=parallel_cfg.token_dispatcher,
                                 routing_replay=not frozen, params_dtype=params_dtype(precision),
                                 **({"implementation": implementation} if implementation is not None else {}))
        self.ddp = None
        self.loss_scale = 1.0
        if frozen:
            self.model.requires_grad_(False)
            self.model.eval()
        else:
            self.ddp = wrap_data_parallel(self.model, overlap_grad_reduce=parallel_cfg.overlap_grad_reduce)
            # losses are normalised by global counts and summed over ranks; DDP averages: undo its 1 / DP
            self.loss_scale = loss_scale_for_sum(self.ddp)
        tp_group = dims.tp_group if dims.tp_size > 1 else None
        if logprob_path == "hidden":
            self.linear_logprobs_fn = _linear_logprob_fn(logprob_impl, logprob_chunk_tokens, tp_group)
        else:
            self.logprobs_fn = _logprob_fn(logprob_impl, tp_group)
        # where the model lives (this rank's GPU, or the CPU): the trainer puts each step's batch there
        self.device = next(self.model.parameters()).device
        if dims.pp_size > 1:
            # Megatron's p2p buffers take this dtype; the shapes are fixed per call (seq_length, micro-batch)
            self.model.config.pipeline_dtype = next(self.model.parameters()).dtype
        if frozen:
            self.replay = None
            return
        self.replay = RoutingReplay(self.model, tp_group=dims.tp_group)
        self.set_micro_batches(1)

    def recording(self):
        """A context recording the routes of the forwards inside it (its `.routes`: [T, Ly, K] of this stage)."""
        return self.replay.recording()

    def replaying(self, routes_TLK, live=None):
        """A context in which the forwards inside it route with `routes_TLK` (R2 / R3); `live`
        (moe.routing_replay.RecordedRoutes): also keep what the routers would have chosen themselves."""
        return self.replay.replaying(routes_TLK, live=live)

    def set_router_aux_loss_coef(self, coef: float) -> float:
        """The routers' load-balancing loss coefficient from now on (rl.router_aux_loss_coef); -> the one before."""
        return set_router_aux_loss_coef(self.model, coef)

    @property
    def replay_spec(self):
        """This stage's MoE layers and the routes' dtype (moe.routing_replay.ReplaySpec)."""
        return self.replay.spec

    def set_micro_batches(self, num_micro_batches: int) -> None:
        """Router aux-loss gradient scale 1 / micro-batches per optimizer step, which DDP's 1 / DP reduction
        makes 1 / (DP * micro-batches): each DP rank and each micro-batch adds its own aux loss (Megatron's
        convention), while the policy losses divide by global counts and are summed over ranks and
        micro-batches. The aux loss is a per-micro-batch estimate, so it (alone) changes with the split; TP
        ranks combine their sequence chunks inside Megatron's router."""
        set_aux_loss_scale(1.0 / num_micro_batches, self.device)

    # ---- forward ---------------------------------------------------------------------------------------
    def token_logprobs(self, input_ids_BS: torch.Tensor, targets_BS: torch.Tensor, unpadded_len: Optional[int] = None):
        """-> logp_BS, entropy_BS of targets under the model (targets[b, s] follows input[b, :s+1]).

        unpadded_len: positions >= it are alignment padding (S rounded up to a multiple of TP): left out of
        the router aux loss, so that it equals the loss of the unpadded batch; causal attention keeps them
        from changing any earlier position's log-prob."""
        return self.logprobs_of(ModelInput.padded(input_ids_BS, targets_BS, unpadded_len))

    def logprobs_of(self, batch: ModelInput):
        """-> logp_BS, entropy_BS of batch.targets_BS (a padded batch or one packed stream, [1, T])."""
        head_input = self._forward_to_head(self.model, batch)
        return self._logprobs_of_head_input(head_input, batch.targets_BS)

    def _forward_to_head(self, model, batch: ModelInput):
        """The forward up to the log-prob computation: hidden_BSH (hidden path) or logits_BSV (logits path) on
        the last stage; on other pipeline stages the activations they send on."""
        if batch.packed is not None:
            check_packed_support(model)
        forward = forward_hidden if self.logprob_path == "hidden" else forward_logits
        return forward(model, batch.input_ids_BS, padding_mask_BS=batch.padding_mask_BS, packed=batch.packed)

    def _logprobs_of_head_input(self, head_input_BSX: torch.Tensor, targets_BS: torch.Tensor):
        """hidden_BSH (with the LM head weight) or logits_BSV -> logp_BS, entropy_BS."""
        b, s, x = head_input_BSX.shape
        if self.logprob_path == "hidden":
            # d weight goes straight into DDP's fp32 gradient buffer (no [V/TP, H] gradient tensor)
            grad_buffer = output_weight_grad_buffer(self.model) if torch.is_grad_enabled() else None
            logp_T, ent_T = self.linear_logprobs_fn(head_input_BSX.reshape(b * s, x), output_weight(self.model),
                                                    targets_BS.reshape(-1), grad_buffer)
        else:
            logp_T, ent_T = self.logprobs_fn(head_input_BSX.reshape(b * s, x), targets_BS.reshape(-1))
        return logp_T.reshape(b, s), ent_T.reshape(b, s)

    @property
    def _overlap(self) -> bool:
        return self.ddp is not None and self.ddp.ddp_config.overlap_grad_reduce

    def _grad_sync(self, last: bool):
        """With overlap_grad_reduce, the backward of every micro-batch but the last runs under DDP's no_sync:
        its gradients accumulate in the buffers, and the buckets' reductions start during the last backward."""
        if self._overlap and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def run_micro_batches(
        self,
        batches: Sequence[Union[ModelInput, Tuple[torch.Tensor, torch.Tensor]]],
        unpadded_len: Optional[int] = None,
        *,
        context: Optional[Callable[[int], ContextManager]] = None,
        loss_fn: Optional[Callable] = None,
    ) -> List:
        """Forward (and with `loss_fn`, backward) of micro-batches i = 0..n-1: ModelInputs (padded or packed;
        under PP packed streams may differ in length, Megatron's schedule then sends each activation's shape
        first), or (input_BS, target_BS) pairs of one shape whose positions >= unpadded_len are alignment
        padding. `context(i)` is entered around micro-batch i's forward on every stage (routing record /
        replay: each stage records or replays its own layers). Where the LM head is (the last stage; every
        rank without PP) result i is `loss_fn(i, logp_BS, entropy_BS)[1]`, whose loss [0] is backpropagated
        (gradients accumulate in .grad), or (logp_BS, entropy_BS) without `loss_fn` (forward only, no
        autograd graph). On the other stages result i is None.

        Scaling: the losses divide by global counts and are summed over data-parallel ranks, while Megatron's
        DDP scales gradients by 1 / DP, so the backpropagated loss is loss_fn's times DP (`self.loss_scale`).
        Under PP, Megatron's schedule also divides each micro-batch loss by the number of micro-batches n and
        sets the router aux-loss scale to 1 / n (as `set_micro_batches` does), so the loss is handed over
        multiplied by DP * n: the gradient is exactly that of the loss loss_fn made."""
        batches = [b if isinstance(b, ModelInput) else ModelInput.padded(*b, unpadded_len) for b in batches]
        n = len(batches)
        results: List = [None] * n
        enter = context or (lambda i: contextlib.nullcontext())
        train = loss_fn is not None
        if self.dims.pp_size == 1:
            with torch.set_grad_enabled(train):
                for i, batch in enumerate(batches):
                    with enter(i):
                        logp_BS, ent_BS = self.logprobs_of(batch)
                    if not train:
                        results[i] = (logp_BS, ent_BS)
                        continue
                    loss, results[i] = loss_fn(i, logp_BS, ent_BS)
                    with self._grad_sync(last=i == n - 1):
                        (loss * self.loss_scale).backward()  # into the DDP's fp32 gradient buffers
            return results
        return self._run_pipeline(batches, enter, loss_fn, results)

    def _run_pipeline(self, batches: List[ModelInput], enter, loss_fn, results):
        n = len(batches)
        train = loss_fn is not None
        shapes = {tuple(b.input_ids_BS.shape) for b in batches}
        if len(shapes) > 1 and any(b.packed is None for b in batches):
            raise ValueError(f"pipeline micro-batches of padded rows must share one shape, got {sorted(shapes)} "
                             "(the p2p buffers are sized once per call)")
        batch, seq_len = batches[0].input_ids_BS.shape
        # packed streams of different lengths: each p2p send is preceded by its shape (Megatron's option)
        self.model.config.variable_seq_lengths = len(shapes) > 1
        loss_multiplier = (self.loss_scale if train else 1.0) * n
        self.model.config.grad_scale_func = None
        # with overlap_grad_reduce the schedule runs every backward but the last under DDP's no_sync
        self.model.config.no_sync_func = self.ddp.no_sync if train and self._overlap else None

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            target_BS = batches[i].targets_BS
            with enter(i):
                output = self._forward_to_head(model, batches[i])

            def loss_func(head_input_BSX, i=i, target_BS=target_BS):
                logp_BS, ent_BS = self._logprobs_of_head_input(head_input_BSX, target_BS)
                if not train:
                    return head_input_BSX.new_zeros(()), (i, (logp_BS, ent_BS))
                loss, result = loss_fn(i, logp_BS, ent_BS)
                return loss * loss_multiplier, (i, result)

            return output, loss_func

        with torch.set_grad_enabled(train):
            store = run_schedule(forward_step, self.model, n, seq_len, batch, forward_only=not train)
        for i, result in store:
            results[i] = result
        return results

    # ---- gradients and updates -------------------------------------------------------------------------
    def make_optimizer(self, settings):
        """Megatron-Core's distributed optimizer over this policy (moe.optimizer.OptimizerSettings)."""
        return build_optimizer(self.ddp, settings, adamw_class=self.adamw_class)

    def zero_grad(self) -> None:
        """Empty the fp32 gradient buffers before a mini-batch's micro-batches accumulate into them."""
        zero_gradients(self.ddp)

    def finish_grads(self) -> None:
        """Megatron's finalize_model_grads: gradients SUMMED over data-parallel ranks (dense over DP, experts
        over expert-DP; reduce-scattered for the distributed optimizer), sequence-parallel partial gradients
        over TP, the tied embedding over the first and last pipeline stages."""
        finish_gradients(self.ddp)

    def step(self, optimizer) -> float:
        """finish_grads, then the optimizer's clip (global L2 norm over the whole model) and update.
        -> the pre-clip gradient norm, equal on every rank."""
        self.finish_grads()
        return optimizer_step(optimizer)

    # ---- weights ---------------------------------------------------------------------------------------
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The TP=EP=1 Megatron state dict on every rank (TP shards and EP experts all-gathered).
        Collective over TP and EP: every rank calls it."""
        return gather_full_state_dict(self.model, dims=self.dims)

    def gather_full(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Per-parameter tensors keyed by local name (e.g. Adam moments) -> full names and TP=EP=1 shapes."""
        return gather_full_state_dict(self.model, tensors, dims=self.dims)

    def load_full_state_dict(self, full: Dict[str, torch.Tensor]) -> None:
        load_full_state_dict(self.model, full)


def build_sequences(prompt_ids: list, response_RL: Optional[torch.Tensor], mask_RL: Optional[torch.Tensor],
                    pad_id: int, length: Optional[int] = None):
    """prompt + response rows, right-padded -> (input_BS, target_BS, loss_mask_BS, resp_pos_RL).

    loss_mask marks target positions holding response tokens; resp_pos_RL[r, t] = position in [S] whose
    target is response token t (so engine per-token values can be scattered onto the [B, S] layout)."""
    rows = len(prompt_ids)
    resp_len = 0 if response_RL is None else response_RL.shape[1]
    total = max(len(p) for p in prompt_ids) + resp_len
    total = max(total, (length or 0) + 1)
    tokens = torch.full((rows, total), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, total), dtype=torch.bool)
    resp_pos = torch.zeros((rows, max(resp_len, 1)), dtype=torch.long)
    for r, p in enumerate(prompt_ids):
        n = len(p)
        tokens[r, :n] = torch.tensor(p, dtype=torch.long)
        if resp_len:
            tokens[r, n:n + resp_len] = response_RL[r]
            loss_mask[r, n:n + resp_len] = mask_RL[r]
            resp_pos[r] = torch.arange(n - 1, n - 1 + resp_len)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), loss_mask[:, 1:].contiguous(), resp_pos


__all__ = ["MegatronPolicy", "ModelInput", "build_sequences", "setup_parallel", "F"]
