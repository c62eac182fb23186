"""Gradient reduction after backward, on plain `.grad`, for any TP/EP/DP layout (what Megatron's
`finalize_model_grads` does for its DDP buffers, without needing Megatron's DDP wrapper).

1. Parameters replicated over TP whose inputs are sequence-split (norms, router: marked `sequence_parallel`)
   and the q/k layernorms (shared over heads that TP splits) hold partial gradients: sum over the TP group.
2. Dense parameters are replicated over data parallelism, expert parameters over expert-data parallelism:
   sum over that group (losses normalised by global counts), or average (each rank saw the same batch).
3. Tied word embeddings with pipeline parallelism: the first stage's embedding and the last stage's copy of
   it (`output_layer.weight`, Megatron's `shared` parameter) each hold the gradient of one use: sum over
   Megatron's embedding group (first and last stage), as finalize_model_grads' `_allreduce_word_embedding_grads`.
`clip_grad_norm_` then takes the global gradient norm over the TP / expert-TP / EP / PP grid (each element once).
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
    _allreduce_tied_embedding_grad(model)


def _allreduce_tied_embedding_grad(model) -> None:
    """With share_embeddings_and_output_weights and PP > 1: sum the word-embedding gradient of the first
    stage and of the last stage's copy over the embedding group, so both copies take the same update."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not getattr(model, "share_embeddings_and_output_weights",
                                                                        False):
        return
    group = ps.get_embedding_group(check_initialized=False)
    if group is None or torch.distributed.get_rank() not in torch.distributed.get_process_group_ranks(group):
        return  # a middle stage: holds no copy
    weight = model.shared_embedding_or_output_weight()
    if weight is None:
        return
    if weight.grad is None:  # not reached after reduce_gradients' zero fill; kept for direct callers
        weight.grad = torch.zeros_like(weight)
    torch.distributed.all_reduce(weight.grad, group=group)


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Global L2 norm of the (already reduced) gradients over the whole model, and in-place clipping by
    min(1, max_norm / (norm + eps)); returns the pre-clip norm, equal on every rank.

    Each gradient element is counted once across the model-parallel grid: a tensor-parallel shard
    (`tensor_model_parallel`) on every rank of its TP group (expert-TP for experts), a TP-replicated tensor
    (norms, router, q/k layernorms; expert weights when expert-TP = 1) on TP rank 0 only; dense squares are
    summed over TP, expert squares over expert-TP and then EP, and the total over the pipeline stages (each
    holds different layers); the last stage's copy of a tied embedding (`shared`) is left out, as in
    Megatron's clip_grads. The replicas over data parallelism hold the same reduced gradient and are not
    summed."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp_rank, etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    ep_size = ps.get_expert_model_parallel_world_size()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    grads = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    device = grads[0][1].grad.device if grads else torch.device("cpu")
    dense_sq = torch.zeros((), dtype=torch.float32, device=device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    for name, p in grads:
        if getattr(p, "shared", False):
            continue  # the tied embedding's copy on the last pipeline stage: counted on the first
        expert = is_expert_param(name)
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        if not sharded and (etp_rank if expert else tp_rank) != 0:
            continue
        sq = p.grad.detach().float().pow(2).sum()
        if expert:
            expert_sq += sq
        else:
            dense_sq += sq
    if tp_size > 1:
        torch.distributed.all_reduce(dense_sq, group=ps.get_tensor_model_parallel_group())
    if etp_size > 1:
        torch.distributed.all_reduce(expert_sq, group=ps.get_expert_tensor_parallel_group())
    if ep_size > 1:
        torch.distributed.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
    total_sq = dense_sq + expert_sq
    if pp_size > 1:
        torch.distributed.all_reduce(total_sq, group=ps.get_pipeline_model_parallel_group())
    norm = total_sq.sqrt()
    scale = torch.clamp(max_norm / (norm + eps), max=1.0)
    for _, p in grads:
        p.grad.mul_(scale.to(p.grad.dtype))
    return norm
