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

Fused AdamW on CUDA (`fused_adamw`, entered by `build_optimizer`): without Transformer Engine or apex,
megatron-core 0.16.1 builds torch's AdamW with no `fused=` (`_get_megatron_optimizer_based_on_param_groups`:
`adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam`), i.e. the foreach
kernels: several passes over the fp32 master weights and both moments per step. Around building the
optimizer, on CUDA parameters only, that function sees a `torch` whose `optim.AdamW` is torch's own class built
with `fused=True` (one fused kernel per dtype/device group); nothing else changes, nothing outside the block.
The patched function's signature and the line it is for are checked first (`verify_fused_adamw_target`, raising
`OptimizerPatchError`), the change is logged once. On the CPU the path stays as it was: torch's fused CPU AdamW
exists but differs from the for-loop path in the last bits (measured with torch 2.13), which would move the
golden metrics.

On a CUDA-less host the CPU shim (`moe.cpu_shim`: device='cuda' literals in the optimizer modules, the
gradient-norm helper, and `cuda_tensor_types` entered here around the optimizer's type checks) lets this
exact code run, so the CPU tests exercise the production optimizer.

Legend: DP data-parallel ranks of the dense parameters.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from moe import cuda_calls
from moe.cpu_shim import cuda_tensor_types

logger = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OptimizerSetupError(ValueError):
    """An optimizer or precision setting is invalid; the message names it."""


class OptimizerPatchError(RuntimeError):
    """The Megatron-Core or torch symbol the fused-AdamW patch is for is missing or changed: review
    moe/optimizer.py (`fused_adamw`)."""


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
    return cuda_tensor_types()


# The function of megatron.core.optimizer (megatron-core 0.16.1) that picks the Adam class, its signature and the
# line that picks torch's AdamW when Transformer Engine and apex are absent (USING_PYTORCH_OPTIMIZER).
FUSED_ADAMW_MODULE = "megatron.core.optimizer"
FUSED_ADAMW_FUNCTION = "_get_megatron_optimizer_based_on_param_groups"
FUSED_ADAMW_SIGNATURE = (
    "(config: megatron.core.optimizer.optimizer_config.OptimizerConfig, model_chunks: List[megatron.core."
    "transformer.module.MegatronModule], param_groups: List, per_model_buffers: Optional[Dict[int, List[megatron."
    "core.distributed.param_and_grad_buffer._ParamAndGradBuffer]]] = None, model_parallel_group: Optional[torch."
    "distributed.distributed_c10d.ProcessGroup] = None, data_parallel_group: Optional[torch.distributed."
    "distributed_c10d.ProcessGroup] = None, data_parallel_group_gloo: Optional[torch.distributed.distributed_c10d."
    "ProcessGroup] = None, data_parallel_group_idx: Optional[int] = None, intra_dist_opt_group: Optional[torch."
    "distributed.distributed_c10d.ProcessGroup] = None, distributed_optimizer_instance_id: Optional[int] = 0, "
    "pg_collection: Optional[megatron.core.process_groups_config.ProcessGroupCollection] = None) -> megatron.core."
    "optimizer.optimizer.MegatronOptimizer")
FUSED_ADAMW_SOURCE = "adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam"
_FUSED_ADAMW_LOGGED = [False]


def verify_fused_adamw_target(adamw_class: type = torch.optim.AdamW) -> None:
    """Raise OptimizerPatchError unless Megatron's Adam picker has the signature and the AdamW line the patch was
    written for, its module the `torch` and `USING_PYTORCH_OPTIMIZER` globals it swaps / reads, and torch's AdamW
    (`adamw_class`, the class the patch builds) a keyword `fused` argument (checked by name only: the GPU host's
    torch differs from the CPU pin)."""
    import importlib

    module = importlib.import_module(FUSED_ADAMW_MODULE)
    where = f"{FUSED_ADAMW_MODULE}.{FUSED_ADAMW_FUNCTION}"
    function = getattr(module, FUSED_ADAMW_FUNCTION, None)
    if function is None:
        raise OptimizerPatchError(f"fused AdamW patch: {where} no longer exists — review moe/optimizer.py")
    actual = str(inspect.signature(function))
    if actual != FUSED_ADAMW_SIGNATURE:
        raise OptimizerPatchError(f"fused AdamW patch: {where} changed signature:\n  expected {FUSED_ADAMW_SIGNATURE}"
                                  f"\n  found    {actual}\nreview moe/optimizer.py")
    if FUSED_ADAMW_SOURCE not in inspect.getsource(function):
        raise OptimizerPatchError(f"fused AdamW patch: {where} no longer picks the Adam class with "
                                  f"{FUSED_ADAMW_SOURCE!r} — review moe/optimizer.py")
    if getattr(module, "torch", None) is not torch or not hasattr(module, "USING_PYTORCH_OPTIMIZER"):
        raise OptimizerPatchError(f"fused AdamW patch: {FUSED_ADAMW_MODULE} no longer has the module globals torch "
                                  "and USING_PYTORCH_OPTIMIZER — review moe/optimizer.py")
    fused = inspect.signature(adamw_class.__init__).parameters.get("fused")
    if fused is None or fused.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise OptimizerPatchError(f"fused AdamW patch: torch {torch.__version__}'s AdamW has no keyword argument "
                                  "'fused' — review moe/optimizer.py")


class _AdamWOptim:
    """torch.optim as Megatron's Adam picker sees it inside `fused_adamw` / `build_optimizer(adamw_class=...)`:
    AdamW is `adamw_class` (torch's by default), built with fused=True when asked."""

    def __init__(self, adamw_class: type, fused: bool) -> None:
        self._adamw_class = adamw_class
        self._fused = fused

    def __getattr__(self, name):
        return getattr(torch.optim, name)

    def AdamW(self, *args, **kwargs):  # noqa: N802 (torch's name)
        return cuda_calls.adamw(self._adamw_class, args, kwargs, fused=self._fused)


class _AdamWTorch:
    """torch as megatron.core.optimizer sees it inside the patch: `optim` is an `_AdamWOptim`; every other name
    is torch's own."""

    def __init__(self, adamw_class: type, fused: bool) -> None:
        self.optim = _AdamWOptim(adamw_class, fused)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def fused_adamw(enabled: bool, adamw_class: Optional[type] = None):
    """Within the block, when `enabled` and Megatron uses torch's optimizers (no TE / apex), Megatron's Adam
    picker builds `torch.optim.AdamW(..., fused=True)`; restored on exit. Yields whether it patched. Checks
    the target first (`verify_fused_adamw_target`); logs the change once per process. `adamw_class`: the
    class built instead of torch.optim.AdamW (a subclass of it; fused or not as `enabled` says)."""
    import megatron.core.optimizer as megatron_optimizer

    if adamw_class is not None and not getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        raise OptimizerSetupError("adamw_class is honoured only where Megatron builds torch's AdamW (no Transformer "
                                  "Engine / apex optimizer)")
    if (not enabled and adamw_class is None) or not getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        yield False
        return
    verify_fused_adamw_target(adamw_class or torch.optim.AdamW)
    if enabled and not _FUSED_ADAMW_LOGGED[0]:
        logger.warning("megagspo optimizer: Megatron's torch AdamW (Transformer Engine / apex absent) is built with "
                       "fused=True (%s.%s sees torch.optim.AdamW with fused=True while the optimizer is built)",
                       FUSED_ADAMW_MODULE, FUSED_ADAMW_FUNCTION)
        _FUSED_ADAMW_LOGGED[0] = True
    megatron_optimizer.torch = _AdamWTorch(adamw_class or torch.optim.AdamW, enabled)
    try:
        yield True
    finally:
        megatron_optimizer.torch = torch


def wrap_data_parallel(model, *, bucket_size: Optional[int] = None, overlap_grad_reduce: bool = False):
    """Megatron-Core DistributedDataParallel around `model` (fp32 gradient buffers, distributed optimizer
    layout). `overlap_grad_reduce=True` starts each bucket's reduction during backward; the caller then runs
    every micro-batch but the last inside `ddp.no_sync()`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=overlap_grad_reduce, bucket_size=bucket_size)
    return DistributedDataParallel(model.config, ddp_config, model)


def takes_gradient_in_main_grad(param: torch.Tensor) -> bool:
    """Whether Megatron DDP's grad-ready hook of `param` honours `grad_added_to_main_grad` (megatron-core
    0.16.1 distributed_data_parallel.py, `_make_backward_post_hook`): the parameter has DDP's fp32 `main_grad`
    and the flag, and is not `zero_out_wgrad` (Megatron sets that on the embedding shared with the output layer
    on one pipeline stage; its hook adds `param.grad` whatever the flag says)."""
    return (getattr(param, "main_grad", None) is not None and hasattr(param, "grad_added_to_main_grad")
            and not getattr(param, "zero_out_wgrad", False))


def gradient_added_to_main_grad(param: torch.Tensor) -> torch.Tensor:
    """What a backward hands autograd for `param` once it has added the gradient into `param.main_grad`
    itself (as Megatron's fused-wgrad linears and TE do; only for `takes_gradient_in_main_grad` parameters):
    the flag makes the grad-ready hook skip its own add, and the returned gradient only has to exist (the hook
    asserts `param.grad is not None` under overlap_grad_reduce before it marks the parameter ready for its
    bucket, then sets it to None; a defined CUDA gradient also keeps the hook on the device's backward thread,
    in order with the other parameters'). Its values are never read, so it is a detached alias of the weight's
    own storage (Megatron and TE use an uninitialised torch.empty): AccumulateGrad adopts it as `param.grad`
    without an allocation or a copy."""
    param.grad_added_to_main_grad = True
    return param.detach()


def loss_scale_for_sum(ddp_model) -> float:
    """What a loss normalised by global counts is multiplied by before backward, so that DDP's 1 / DP scaling
    leaves the SUM of the ranks' gradients."""
    return float(ddp_model.dp_cp_group.size()) if hasattr(ddp_model, "dp_cp_group") else 1.0


def build_optimizer(ddp_model, settings: OptimizerSettings, fused: Optional[bool] = None,
                    adamw_class: Optional[type] = None):
    """Megatron-Core's distributed optimizer over `ddp_model`'s parameters (fp32 master weights for bf16
    parameters; moments and master weights sharded over data parallelism). `fused`: torch's fused AdamW
    (`fused_adamw`); None = where the parameters are on CUDA. `adamw_class`: the torch optimizer Megatron wraps
    (a torch.optim.AdamW subclass; default AdamW itself): tests pass one whose update is linear in the gradient."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    param = next(ddp_model.module.parameters())
    dtype = param.dtype
    if fused is None:
        fused = param.is_cuda
    config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.beta1, adam_beta2=settings.beta2, adam_eps=settings.eps,
        bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype, clip_grad=settings.clip_grad,
        use_distributed_optimizer=True)
    if not config.decoupled_weight_decay:  # the patch replaces AdamW only
        raise OptimizerSetupError("the optimizer is AdamW: OptimizerConfig.decoupled_weight_decay must stay True")
    with _optimizer_scope(), fused_adamw(fused, adamw_class):
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
