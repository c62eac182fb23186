"""The Megatron-Core calls a training step makes around the model, so that callers outside `moe/` never reach
into Megatron: the pipeline schedule over micro-batches (1F1B when PP > 1), the router aux-loss scale, and the
all-gather of vocab-parallel logits."""

from __future__ import annotations

from typing import Callable, List

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from moe.cpu_shim import pipeline_schedule_on_cpu


def set_aux_loss_scale(scale: float, device: torch.device) -> None:
    """The gradient scale of every MoE layer's router aux loss; shape [1] on the model's device (the aux loss
    it scales is there), as Megatron's pipeline schedules set it (they copy_ a [1] tensor into this one)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([scale], device=device))


def run_schedule(forward_step: Callable, model, num_micro_batches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool) -> List:
    """Megatron's forward-backward schedule for the model's pipeline (non-interleaved 1F1B under PP > 1) over
    micro-batch indices 0..n-1 fed to `forward_step(data_iterator, model)`; -> the losses' reduced outputs of
    the last stage (Megatron's `forward_data_store`). On a CPU host the schedule's CUDA-only counter is moved
    to the CPU (moe.cpu_shim.pipeline_schedule_on_cpu)."""
    with pipeline_schedule_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(num_micro_batches)), model=[model],
            num_microbatches=num_micro_batches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=forward_only)


def gather_vocab_shards(logits_TV: torch.Tensor) -> torch.Tensor:
    """This TP rank's vocab shard [T, V/TP] -> the full [T, V] logits (differentiable all-gather over TP)."""
    return gather_from_tensor_model_parallel_region(logits_TV)
