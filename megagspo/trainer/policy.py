"""The policy on Megatron-Core: distributed set-up, model build, token log-probs, gradient reduction,
global gradient norm, full-state export for the rollout engine (gathering experts over EP).

Legend: B rows, S sequence length (model input), V vocab, T = B*S tokens in storage order (b*S + s).
"""

from __future__ import annotations

import re
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


def _logprob_fn(impl: str):
    """(logits_TV, target_T) -> (logp_T, entropy_T). megagspo.kernels when importable (impl auto)."""
    if impl in ("auto", "kernels"):
        try:
            from megagspo.kernels import token_logprobs
        except ImportError:
            if impl == "kernels":
                raise
            token_logprobs = None
        if token_logprobs is not None:
            return lambda logits, target: token_logprobs(logits, target, with_entropy=True)

    def torch_logprobs(logits_TV, target_T):
        logsm_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        logp_T = logsm_TV.gather(-1, target_T[:, None]).squeeze(-1)
        entropy_T = -(logsm_TV.exp() * logsm_TV).sum(-1)
        return logp_T, entropy_T

    return torch_logprobs


class MegatronPolicy:
    def __init__(self, arch, layout, parallel_cfg, logprob_impl: str = "auto") -> None:
        from megatron.core import parallel_state as ps

        from moe.model import build_model

        self.arch = arch
        self.model = build_model(arch, layout, token_dispatcher=parallel_cfg.token_dispatcher, routing_replay=True)
        self.logprobs_fn = _logprob_fn(logprob_impl)
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        from moe.routing_replay import RoutingReplay

        self.replay = RoutingReplay(self.model)
        if self.dp_size > 1:
            # Each DP rank adds its own router aux loss; losses here are summed over ranks.
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / self.dp_size))

    # ---- forward ---------------------------------------------------------------------------------------
    def token_logprobs(self, input_ids_BS: torch.Tensor, targets_BS: torch.Tensor):
        """-> logp_BS, entropy_BS of targets under the model (targets[b, s] follows input[b, :s+1])."""
        from moe.model import forward_logits

        logits_BSV = forward_logits(self.model, input_ids_BS)
        b, s, v = logits_BSV.shape
        logp_T, ent_T = self.logprobs_fn(logits_BSV.reshape(b * s, v), targets_BS.reshape(-1))
        return logp_T.reshape(b, s), ent_T.reshape(b, s)

    def lm_loss(self, input_ids_BS, targets_BS, mask_BS, num_global_tokens):
        logp_BS, _ = self.token_logprobs(input_ids_BS, targets_BS)
        return -(logp_BS * mask_BS).sum() / num_global_tokens

    # ---- gradients -------------------------------------------------------------------------------------
    def _is_expert(self, name: str) -> bool:
        from moe.sharding import is_expert_param

        return is_expert_param(name)

    def reduce_grads(self) -> None:
        """SUM gradients over data-parallel ranks (losses divide by global counts): dense params over DP,
        expert params over expert-DP (what Megatron's finalize_model_grads does)."""
        from moe.grads import reduce_gradients

        reduce_gradients(self.model)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm (expert shards summed over EP) and in-place clipping; returns the pre-clip norm."""
        dense = torch.zeros(())
        expert = torch.zeros(())
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if self._is_expert(name):
                expert += sq
            else:
                dense += sq
        if self.ep_size > 1:
            torch.distributed.all_reduce(expert, group=self.ep_group)
        norm = (dense + expert).sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return norm

    # ---- weights ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The TP=EP=1 Megatron state dict on every rank (local experts all-gathered over EP)."""
        num_local = self.arch.num_experts // self.ep_size
        out: Dict[str, torch.Tensor] = {}
        pat = re.compile(r"(.*local_experts\.)(\d+)(\..*)")
        for name, p in self.model.named_parameters():
            m = pat.match(name)
            if m is None:
                out[name] = p.detach().clone()
                continue
            local = int(m.group(2))
            if self.ep_size == 1:
                out[name] = p.detach().clone()
                continue
            parts = [torch.empty_like(p) for _ in range(self.ep_size)]
            torch.distributed.all_gather(parts, p.detach().contiguous(), group=self.ep_group)
            for r, t in enumerate(parts):
                out[f"{m.group(1)}{r * num_local + local}{m.group(3)}"] = t
        return out

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
