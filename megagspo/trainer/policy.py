"""The policy on Megatron-Core: distributed set-up, model build, token log-probs, gradient reduction,
global gradient norm, full-state export for the rollout engine (gathering TP shards and EP experts).

Tensor parallelism: the LM head's logits stay vocab-parallel ([B, S, V/TP] per rank) and go straight into
the vocab-parallel log-prob kernel (megagspo.kernels.token_logprobs with the TP group: partial max/sum-exp
all-reduced, no [T, V] gather); the TP ranks of one data-parallel rank get identical log-probs, losses and
metrics. With sequence parallelism S must be a multiple of TP (`seq_multiple`).

Legend: B rows, S sequence length (model input), V vocab (V/TP local), T = B*S tokens in storage order (b*S + s).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F


def setup_parallel(parallel_cfg, seed: int):
    """torch.distributed (gloo on CPU; 1 rank without torchrun) + Megatron groups. -> (layout, rank, world)."""
    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.parallel import ParallelLayout, init_distributed, initialize_model_parallel

    if not torch.cuda.is_available():
        apply_cpu_shim()
    init_distributed()
    layout = ParallelLayout(tensor_parallel=parallel_cfg.tensor_parallel, expert_parallel=parallel_cfg.expert_parallel)
    initialize_model_parallel(layout)
    initialize_cpu_rng(seed)
    return layout, torch.distributed.get_rank(), torch.distributed.get_world_size()


def _logprob_fn(impl: str, tp_group=None):
    """(logits_TV, target_T) -> (logp_T, entropy_T). megagspo.kernels when importable (impl auto).

    tp_group (TP > 1): logits_TV is this rank's vocab shard; the kernels combine the shards' statistics
    over the group; the naive torch path all-gathers the full [T, V] logits first (differentiably)."""
    if impl in ("auto", "kernels"):
        try:
            from megagspo.kernels import token_logprobs
        except ImportError:
            if impl == "kernels":
                raise
            token_logprobs = None
        if token_logprobs is not None:
            return lambda logits, target: token_logprobs(logits, target, with_entropy=True, tp_group=tp_group)

    def torch_logprobs(logits_TV, target_T):
        if tp_group is not None:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits_TV = gather_from_tensor_model_parallel_region(logits_TV)
        logsm_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        logp_T = logsm_TV.gather(-1, target_T[:, None]).squeeze(-1)
        entropy_T = -(logsm_TV.exp() * logsm_TV).sum(-1)
        return logp_T, entropy_T

    return torch_logprobs


class MegatronPolicy:
    def __init__(self, arch, layout, parallel_cfg, logprob_impl: str = "auto", *, frozen: bool = False) -> None:
        """frozen=True: the KL reference policy (rl.kl_coef > 0): the same layout and log-prob path, no
        gradients, eval mode, and no routing replay (it always routes with its own router; see rl_step)."""
        from megatron.core import parallel_state as ps

        from moe.model import build_model

        self.arch = arch
        self.frozen = frozen
        self.model = build_model(arch, layout, token_dispatcher=parallel_cfg.token_dispatcher,
                                 routing_replay=not frozen)
        if frozen:
            self.model.requires_grad_(False)
            self.model.eval()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.seq_multiple = self.tp_size  # sequence parallelism splits S over the TP ranks
        self.logprobs_fn = _logprob_fn(logprob_impl, self.tp_group if self.tp_size > 1 else None)
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        if frozen:
            self.replay = None
            return
        from moe.routing_replay import RoutingReplay

        self.replay = RoutingReplay(self.model)
        self.set_micro_batches(1)

    def set_micro_batches(self, num_micro_batches: int) -> None:
        """Router aux-loss gradient scale 1 / (DP * micro-batches per optimizer step): each DP rank and each
        micro-batch adds its own aux loss (Megatron's convention), while the policy losses divide by global
        counts and are summed over ranks and micro-batches. The aux loss is a per-micro-batch estimate, so it
        (alone) changes with the split; TP ranks combine their sequence chunks inside Megatron's router."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / (self.dp_size * num_micro_batches)))

    # ---- forward ---------------------------------------------------------------------------------------
    def token_logprobs(self, input_ids_BS: torch.Tensor, targets_BS: torch.Tensor, unpadded_len: Optional[int] = None):
        """-> logp_BS, entropy_BS of targets under the model (targets[b, s] follows input[b, :s+1]).

        unpadded_len: positions >= it are alignment padding (S rounded up to a multiple of TP): left out of
        the router aux loss, so that it equals the loss of the unpadded batch; causal attention keeps them
        from changing any earlier position's log-prob."""
        from moe.model import forward_logits

        seq_len = input_ids_BS.shape[1]
        padding_BS = None
        if unpadded_len is not None and unpadded_len < seq_len:
            padding_BS = (torch.arange(seq_len, device=input_ids_BS.device) >= unpadded_len).expand_as(input_ids_BS)
        logits_BSV = forward_logits(self.model, input_ids_BS, padding_mask_BS=padding_BS)
        b, s, v = logits_BSV.shape
        logp_T, ent_T = self.logprobs_fn(logits_BSV.reshape(b * s, v), targets_BS.reshape(-1))
        return logp_T.reshape(b, s), ent_T.reshape(b, s)

    def lm_loss(self, input_ids_BS, targets_BS, mask_BS, num_global_tokens, unpadded_len: Optional[int] = None):
        logp_BS, _ = self.token_logprobs(input_ids_BS, targets_BS, unpadded_len)
        return -(logp_BS * mask_BS).sum() / num_global_tokens

    # ---- gradients -------------------------------------------------------------------------------------
    def reduce_grads(self) -> None:
        """SUM gradients over data-parallel ranks (losses divide by global counts): dense params over DP,
        expert params over expert-DP, sequence-parallel partial gradients over TP (what Megatron's
        finalize_model_grads does)."""
        from moe.grads import reduce_gradients

        reduce_gradients(self.model)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm (TP shards summed over TP, TP-replicated tensors once, expert shards summed over
        EP) and in-place clipping; returns the pre-clip norm."""
        from moe.grads import clip_grad_norm_

        return clip_grad_norm_(self.model, max_norm)

    # ---- weights ---------------------------------------------------------------------------------------
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The TP=EP=1 Megatron state dict on every rank (TP shards and EP experts all-gathered).
        Collective over TP and EP: every rank calls it."""
        from moe.sharding import gather_full_state_dict

        return gather_full_state_dict(self.model)

    def gather_full(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Per-parameter tensors keyed by local name (e.g. Adam moments) -> full names and TP=EP=1 shapes."""
        from moe.sharding import gather_full_state_dict

        return gather_full_state_dict(self.model, tensors)

    def load_full_state_dict(self, full: Dict[str, torch.Tensor]) -> None:
        from moe.sharding import load_full_state_dict

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


__all__ = ["MegatronPolicy", "build_sequences", "setup_parallel", "F"]
