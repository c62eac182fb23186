"""Gradient reduction after backward, on plain `.grad`, for any TP/EP/DP layout (what Megatron's
`finalize_model_grads` does for its DDP buffers, without needing Megatron's DDP wrapper).

1. Parameters replicated over TP whose inputs are sequence-split (norms, router: marked `sequence_parallel`)
   and the q/k layernorms (shared over heads that TP splits) hold partial gradients: sum over the TP group.
2. Dense parameters are replicated over data parallelism, expert parameters over expert-data parallelism:
   sum over that group (losses normalised by global counts), or average (each rank saw the same batch).
"""

from __future__ import annotations

import torch

from moe.sharding import is_expert_param


def reduce_gradients(model, *, average_replicas: bool = False) -> None:
    """All-reduce every parameter's `.grad` in place; a parameter without a gradient gets zeros first
    (every rank must enter every collective)."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if tp_size > 1 and (getattr(param, "sequence_parallel", False)
                            or "q_layernorm" in name or "k_layernorm" in name):
            torch.distributed.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
        group = ps.get_expert_data_parallel_group() if is_expert_param(name) else ps.get_data_parallel_group()
        replicas = torch.distributed.get_world_size(group)
        if replicas > 1:
            torch.distributed.all_reduce(param.grad, group=group)
            if average_replicas:
                param.grad /= replicas
