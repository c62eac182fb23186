"""Mixed precision, data-parallel gradients and the optimizer, Megatron-Core's way, on CPU and GPU alike.

- Parameters in the run's precision (`PRECISIONS`: float32, or bfloat16 for GPU recipes), built by
  `moe.model.build_model(params_dtype=...)`.
- `wrap_data_parallel`: Megatron-Core `DistributedDataParallel` holds every gradient in a contiguous fp32
  buffer (`param.main_grad`; backward hooks accumulate micro-batches into it) and reduces it bucket by bucket:
  dense parameters over the data-parallel group, expert parameters over the expert-data-parallel group,
  reduce-scattered for the distributed optimizer. `finish_gradients` (Megatron's `finalize_model_grads`) then
  also sums the sequence-parallel norm / router / q-k-norm gradients over TP and the tied embedding over the
  first and last pipeline stages.
- `build_optimizer`: `get_megatron_optimizer` with the distributed optimizer: fp32 master weights and Adam
  moments sharded over the data-parallel ranks (dense over DP, experts over expert-DP; a ChainedOptimizer
  holds both), global-norm clipping over the whole model-parallel grid inside `step`, updated shards
  all-gathered back into the model's parameters.

Scaling: Megatron's DDP scales each gradient by 1 / DP before summing (it assumes per-rank mean losses). The
RL and SFT losses here are normalised by GLOBAL counts and must be summed over ranks, so callers multiply
each backpropagated loss by `DistributedDataParallel`'s data-parallel size (`loss_scale_for_sum`).

On a CUDA-less host the CPU shim (`moe.cpu_shim`: device='cuda' literals in the optimizer modules, the
gradient-norm helper, and `cuda_tensor_types` entered here around the optimizer's type checks) lets this
exact code run, so the CPU tests exercise the production optimizer.

Legend: DP data-parallel ranks of the dense parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OptimizerSetupError(ValueError):
    """An optimizer or precision setting is invalid; the message names it."""


def params_dtype(precision: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise OptimizerSetupError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


@dataclass(frozen=True)
class OptimizerSettings:
    """One optimizer's hyper-parameters: AdamW with decoupled weight decay (the only optimizer Megatron-Core's
    distributed optimizer accepts). The learning rate is set per step by the caller (`set_lr`); `lr` is the
    value at construction."""

    lr: float
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0  # global L2 norm; 0 = no clipping

    def __post_init__(self) -> None:
        for name, lo, hi in (("lr", 0.0, None), ("weight_decay", 0.0, None), ("beta1", 0.0, 1.0),
                             ("beta2", 0.0, 1.0), ("eps", 0.0, None), ("clip_grad", 0.0, None)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or value < lo or (hi is not None and value >= hi):
                raise OptimizerSetupError(f"optimizer {name} = {value!r} is out of range")


def _optimizer_scope():
    from moe.cpu_shim import cuda_tensor_types

    return cuda_tensor_types()


def wrap_data_parallel(model, *, bucket_size: Optional[int] = None, overlap_grad_reduce: bool = False):
    """Megatron-Core DistributedDataParallel around `model` (fp32 gradient buffers, distributed optimizer
    layout). `overlap_grad_reduce=True` starts each bucket's reduction during backward; the caller then runs
    every micro-batch but the last inside `ddp.no_sync()`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=overlap_grad_reduce, bucket_size=bucket_size)
    return DistributedDataParallel(model.config, ddp_config, model)


def loss_scale_for_sum(ddp_model) -> float:
    """What a loss normalised by global counts is multiplied by before backward, so that DDP's 1 / DP scaling
    leaves the SUM of the ranks' gradients."""
    return float(ddp_model.dp_cp_group.size()) if hasattr(ddp_model, "dp_cp_group") else 1.0


def build_optimizer(ddp_model, settings: OptimizerSettings):
    """Megatron-Core's distributed optimizer over `ddp_model`'s parameters (fp32 master weights for bf16
    parameters; moments and master weights sharded over data parallelism)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = next(ddp_model.module.parameters()).dtype
    config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.beta1, adam_beta2=settings.beta2, adam_eps=settings.eps,
        bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype, clip_grad=settings.clip_grad,
        use_distributed_optimizer=True)
    with _optimizer_scope():
        return get_megatron_optimizer(config, [ddp_model])


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def zero_gradients(ddp_model, optimizer=None) -> None:
    """Empty the fp32 gradient buffers (and the optimizer's master-gradient views) before an accumulation."""
    ddp_model.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()


def finish_gradients(ddp_model) -> None:
    """Megatron's finalize_model_grads: the data-parallel reduce-scatter of every bucket, the TP sum of the
    sequence-parallel / q-k-norm gradients, the tied-embedding sum over the first and last stages."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp_model])


def optimizer_step(optimizer) -> float:
    """Clip by the global gradient norm and update (master weights, then the model's parameters, gathered
    over data parallelism). -> the pre-clip global gradient norm (equal on every rank). Raises
    FloatingPointError when the gradients hold inf / NaN (nothing is updated then)."""
    with _optimizer_scope():
        success, grad_norm, _ = optimizer.step()
    if not success:
        raise FloatingPointError("optimizer step skipped: the gradients hold inf or NaN")
    return float(grad_norm) if grad_norm is not None else 0.0


@torch.no_grad()
def gather_reduced_gradients(ddp_model) -> None:
    """After `finish_gradients`, for checks and tests: the distributed optimizer's reduce-scatter leaves each
    rank's fp32 gradient buffer holding the reduced gradient only in its own shard of every bucket; this
    all-gathers the shards over each bucket's data-parallel group (expert buckets over expert-DP), so that
    every `param.main_grad` holds the full reduced gradient. Collective; the optimizer reads only its own shard,
    so a step after it is unchanged."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for bucket_group in ddp_model.bucket_groups + ddp_model.expert_parallel_bucket_groups:
        size = bucket_group.intra_distributed_optimizer_instance_size
        if size == 1:
            continue
        rank = bucket_group.intra_distributed_optimizer_instance_rank
        for bucket in bucket_group.buckets:
            own = shard_buffer(bucket.grad_data, size)[rank].clone()
            torch.distributed.all_gather_into_tensor(bucket.grad_data, own,
                                                     group=bucket_group.intra_distributed_optimizer_instance_group)
