"""Make Megatron-Core 0.16.1 run MoE models on a host without CUDA.

Applied by an explicit call, `apply_cpu_shim()`, never on import, and only when CUDA is absent. It changes
exactly nine things (each answers a failure measured on Megatron-Core 0.16.1) and logs each one:

1. `torch.cuda.current_device()` is passed as `device=` in ~175 places in Megatron: it returns "cpu".
2. `moe_utils.te_general_gemm` is referenced although Transformer Engine is absent (a NameError in
   Megatron, on GPU too): `moe.megatron_compat.apply_megatron_compat` binds it to None on every device; the
   shim calls it and lists its change among its own.
3. The alltoall token dispatcher builds `torch.cuda.Stream()` and records events on it: stand-ins with
   no-op synchronisation (CPU ops are synchronous, so the ordering they guard is already given).
4. EP>1 with the alltoall dispatcher: `maybe_move_tensor_to_cpu` only converts CUDA tensors, so split
   sizes stay tensors and `all_to_all_single` rejects them: CPU tensors asked for "as numpy" become
   numpy arrays, as CUDA tensors do.
5. TP>1 in training demands sequence parallelism, which the torch-norm fallback refuses: it accepts SP and
   marks its parameters `sequence_parallel` (as TE's norms do), so `finalize_model_grads` all-reduces them.
6. `dist_checkpointing`'s torch_dist save calls `torch.cuda.synchronize()` after staging tensors to host
   memory (`FileSystemWriterAsync.preload_tensors`): a no-op (CPU tensors are already on the host and CPU
   ops are synchronous).
7. Megatron's optimizer modules (`optimizer/optimizer.py`, `clip_grads.py`, `distrib_optimizer.py`) build
   their flags, loss scale and norm accumulators with `device='cuda'` literals: each of those modules sees a
   `torch` whose tensor factories (`tensor`, `zeros`, `empty`, `ones`) put device="cuda" tensors on the CPU
   (every other name is torch's own; torch itself is untouched).
8. Without TE or apex, `clip_grads` computes the gradient norm with `megatron.core.utils.local_multi_tensor_
   l2_norm`, which returns its result with `device="cuda"`: `clip_grads.l2_norm_impl` is replaced by the same
   norm (sqrt of the sum of squared per-tensor L2 norms, in float32) returned on the gradients' device.
9. Activation recompute (`tensor_parallel.checkpoint`, `model.recompute`) saves and restores the RNG states
   around the recomputed forward with `_get_all_rng_states` / `_set_all_rng_states`, which read the CUDA
   generator: on a CUDA-less host they save / restore the CPU generator and the RNG tracker's states only
   (there is no CUDA generator whose state a recompute could disturb).

Besides these global patches, three scoped ones apply only inside a `with` block, only without CUDA:
- `cuda_tensor_types()`, which `moe.optimizer` enters around building and stepping Megatron's optimizer: its
  mixed-precision checks compare `param.type()` with 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor'
  (DistributedOptimizer's constructor, clip_grads' assert); inside the block `Tensor.type()` with no argument
  names a CPU float / bfloat16 / half tensor by its CUDA type name.
- `tensor_cuda_as_identity()`, which `moe.model.build_model` enters only around the GPTModel constructor with
  tied word embeddings and pipeline parallelism: Megatron's `LanguageModule.setup_embeddings_and_output_layer`
  moves the last stage's embedding copy to the GPU (`weight.data.cuda()`) before all-reducing it from the
  first stage; on a CUDA-less host it stays on the CPU.
- `pipeline_schedule_on_cpu()`, which the trainer's policy enters around Megatron's 1F1B pipeline schedule:
  the schedule builds its token counter with `torch.zeros([], device="cuda")`; the schedules module then
  sees a `torch` whose `zeros` puts device="cuda" tensors on the CPU (nothing else changes, nowhere else).

Every patched symbol is checked against the signature it had when this shim was written
(`verify_patch_targets`), so a Megatron upgrade that moves or reshapes one fails loudly here instead of
misbehaving later. The settings a CPU run needs besides the patches are in `CPU_TRANSFORMER_SETTINGS`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from moe.device import use_cuda
from moe.megatron_compat import apply_megatron_compat

logger = logging.getLogger(__name__)

MEGATRON_VERSION = "0.16.1"

# TransformerConfig values a CPU run needs (docs/platform.md): CPU weight init, no grouped GEMM (needs the
# grouped_gemm package), no fused kernels (all CUDA/TE/apex-only).
CPU_TRANSFORMER_SETTINGS: dict = {
    "use_cpu_initialization": True,
    "moe_grouped_gemm": False,
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    "cross_entropy_loss_fusion": False,
}


class MegatronShimError(RuntimeError):
    """A symbol the CPU shim patches is missing or changed shape: Megatron-Core was upgraded."""


@dataclass(frozen=True)
class PatchTarget:
    module: str
    attribute: str  # dotted path inside the module, e.g. "WrappedTorchNorm.__new__"
    signature: str | None  # str(inspect.signature(...)) at Megatron-Core 0.16.1; None: only existence
    why: str


PATCH_TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget("torch.cuda", "current_device", "() -> int", "(1) device= argument throughout Megatron"),
    PatchTarget("torch.cuda", "Stream", None, "(3) dispatcher's device-to-host stream"),
    PatchTarget("torch.cuda", "current_stream",
                "(device: torch.device | str | int | None = None) -> torch.cuda.streams.Stream",
                "(3) dispatcher compares and waits on the current stream"),
    PatchTarget("torch.cuda", "stream", "(stream: Optional[ForwardRef('torch.cuda.Stream')]) -> torch.cuda.StreamContext",
                "(3) dispatcher enters the side stream"),
    PatchTarget("torch.cuda", "synchronize", "(device: torch.device | str | int | None = None) -> None",
                "(6) dist_checkpointing save synchronizes the device after staging tensors"),
    PatchTarget("megatron.core.dist_checkpointing.strategies.filesystem_async",
                "FileSystemWriterAsync.preload_tensors",
                "(write_buckets: List[Tuple[pathlib.Path, str, Tuple[list, list]]], non_blocking=True) -> "
                "List[Tuple[pathlib.Path, str, Tuple[list, list]]]",
                "(6) the caller of torch.cuda.synchronize in the torch_dist save path"),
    PatchTarget("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction.forward", None,
                "(2) references te_general_gemm"),
    PatchTarget("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
                "(tensor: torch.Tensor, as_numpy: bool = False, record_stream: bool = False) -> torch.Tensor",
                "(4) split sizes for all_to_all_single"),
    PatchTarget("megatron.core.transformer.moe.token_dispatcher",
                "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
                "(self, point: str, tokens_per_expert: Optional[torch.Tensor] = None) -> torch.Tensor",
                "(3, 4) the only caller of the stream stand-ins and of maybe_move_tensor_to_cpu"),
    PatchTarget("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__",
                "(self, optimizer: torch.optim.optimizer.Optimizer, config: megatron.core.optimizer."
                "optimizer_config.OptimizerConfig, grad_scaler: Optional[megatron.core.optimizer.grad_scaler."
                "MegatronGradScaler], init_state_fn: Callable)",
                "(7) device='cuda' flags in the optimizer base classes"),
    PatchTarget("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32",
                "(grads_for_norm: Union[List[torch.Tensor], torch.Tensor], norm_type: Union[int, float] = 2, "
                "grad_stats_parallel_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None) "
                "-> float",
                "(7, 8) device='cuda' accumulators and the l2_norm_impl it applies"),
    PatchTarget("megatron.core.optimizer.clip_grads", "l2_norm_impl",
                "(chunk_size, noop_flag, tensor_lists, per_tensor, *args)",
                "(8) TE/apex-less local_multi_tensor_l2_norm returns its result on 'cuda'"),
    PatchTarget("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
                None, "(7, scoped cuda_tensor_types) param.type() checks against torch.cuda type names"),
    PatchTarget("megatron.core.tensor_parallel.random", "_get_all_rng_states", "()",
                "(9) activation recompute saves the CUDA generator's state"),
    PatchTarget("megatron.core.tensor_parallel.random", "_set_all_rng_states",
                "(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker)",
                "(9) activation recompute restores the CUDA generator's state"),
    PatchTarget("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
                "(cls, config: megatron.core.transformer.transformer_config.TransformerConfig, "
                "hidden_size: int, eps: float = 1e-05, persist_layer_norm: bool = False, "
                "zero_centered_gamma: bool = False, normalization: str = 'LayerNorm')",
                "(5) torch norm refuses sequence parallelism"),
)


def _resolve(target: PatchTarget):
    obj = importlib.import_module(target.module)
    for part in target.attribute.split("."):
        if not hasattr(obj, part):
            raise MegatronShimError(
                f"CPU shim: {target.module}.{target.attribute} no longer exists ({target.why}); "
                f"the shim was written for Megatron-Core {MEGATRON_VERSION} — review moe/cpu_shim.py"
            )
        obj = getattr(obj, part)
    return obj


def verify_patch_targets() -> None:
    """Raise MegatronShimError if any patched symbol is missing or its signature changed."""
    for target in PATCH_TARGETS:
        obj = _resolve(target)
        original = getattr(obj, "__megagspo_original__", obj)
        if target.signature is None:
            continue
        actual = str(inspect.signature(original))
        if actual != target.signature:
            raise MegatronShimError(
                f"CPU shim: {target.module}.{target.attribute} changed signature ({target.why}):\n"
                f"  expected {target.signature}\n  found    {actual}\n"
                f"the shim was written for Megatron-Core {MEGATRON_VERSION} — review moe/cpu_shim.py"
            )
    import megatron.core.transformer.moe.moe_utils as moe_utils

    src = inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    if "te_general_gemm" not in src:
        raise MegatronShimError(
            "CPU shim: moe_utils.RouterGatingLinearFunction no longer references te_general_gemm; patch (2) "
            "may be obsolete — review moe/cpu_shim.py"
        )


class _CpuEvent:
    """Stand-in for torch.cuda.Event: CPU work is complete when the call that queued it returns."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stand-in for torch.cuda.Stream with the methods Megatron's alltoall dispatcher calls."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CpuStream()


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_synchronize(device=None) -> None:
    return None


def _cpu_current_stream(device=None) -> _CpuStream:
    return _CURRENT_STREAM


def _cpu_stream_context(stream=None):
    return contextlib.nullcontext()


def _mark_original(new: Callable, original: Callable) -> Callable:
    new.__megagspo_original__ = original  # type: ignore[attr-defined]
    return new


_APPLIED: list[str] = []


def is_applied() -> bool:
    return bool(_APPLIED)


# Over 60 lines: the patches in one place, in the order Megatron-Core needs them, each logged once.
def apply_cpu_shim(force: bool = False) -> list[str]:
    """Patch Megatron-Core for a CUDA-less host; return (and log) a line per change.

    Does nothing when CUDA is available (unless `force`, for tests of the shim itself), and nothing the
    second time. Raises MegatronShimError if Megatron-Core's patched symbols changed.
    """
    if _APPLIED:
        return list(_APPLIED)
    if use_cuda() and not force:
        logger.info("CPU shim not applied: CUDA is available")
        return []
    verify_patch_targets()

    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer_module
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.torch_norm as torch_norm

    changes: list[str] = []

    # (1)
    torch.cuda.current_device = _mark_original(_cpu_current_device, torch.cuda.current_device)
    changes.append("torch.cuda.current_device() -> 'cpu' (Megatron passes it as device=)")

    # (2)
    compat = apply_megatron_compat()  # logged by itself
    changes.extend(compat)

    # (3)
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = _mark_original(_cpu_current_stream, torch.cuda.current_stream)
    torch.cuda.stream = _mark_original(_cpu_stream_context, torch.cuda.stream)
    changes.append("torch.cuda.Stream / current_stream / stream -> synchronous CPU stand-ins")

    # (4)
    original_move = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            # What the GPU path returns (a host numpy array; Megatron calls .tolist() on some of them),
            # so that all_to_all_single receives plain split sizes instead of a tensor.
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = _mark_original(maybe_move_tensor_to_cpu, original_move)
    changes.append("megatron token_dispatcher.maybe_move_tensor_to_cpu: CPU split sizes -> numpy, as on GPU")

    # (5)
    original_new = torch_norm.WrappedTorchNorm.__new__

    def wrapped_torch_norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                               zero_centered_gamma=False, normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        # Build without SP (the norm itself is elementwise over tokens, so SP changes nothing in its
        # math), then mark the params so their gradients are all-reduced over the TP group.
        config_no_sp = _config_without_sequence_parallel(config)
        norm = original_new(cls, config_no_sp, hidden_size, eps, persist_layer_norm,
                            zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = _mark_original(wrapped_torch_norm_new, original_new)
    changes.append("megatron WrappedTorchNorm accepts sequence_parallel and marks its params")

    # (6)
    torch.cuda.synchronize = _mark_original(_cpu_synchronize, torch.cuda.synchronize)
    changes.append("torch.cuda.synchronize() -> no-op (dist_checkpointing save path; CPU work is synchronous)")

    # (7)
    for module in (optimizer_module, clip_grads, distrib_optimizer):
        module.torch = _CpuFactoriesTorch()
    changes.append("megatron optimizer / clip_grads / distrib_optimizer: torch.tensor|zeros|empty|ones(device='cuda') "
                   "-> CPU tensors")

    # (8)
    clip_grads.l2_norm_impl = _mark_original(_l2_norm_on_grad_device, clip_grads.l2_norm_impl)
    changes.append("megatron clip_grads.l2_norm_impl -> the same float32 L2 norm, returned on the CPU")

    # (9)
    import megatron.core.tensor_parallel.random as tp_random

    tracker = tp_random.get_cuda_rng_tracker

    def get_all_rng_states():
        return torch.get_rng_state(), None, tracker().get_states()

    def set_all_rng_states(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker):
        torch.set_rng_state(cpu_rng_state)
        tracker().set_states(cuda_rng_state_tracker)

    tp_random._get_all_rng_states = _mark_original(get_all_rng_states, tp_random._get_all_rng_states)
    tp_random._set_all_rng_states = _mark_original(set_all_rng_states, tp_random._set_all_rng_states)
    changes.append("megatron tensor_parallel.random._get/_set_all_rng_states (activation recompute) -> the CPU "
                   "generator and the RNG tracker, no CUDA generator")

    for line in changes:
        if line not in compat:
            logger.warning("megagspo CPU shim: %s", line)
    _APPLIED.extend(changes)
    return list(changes)


@contextlib.contextmanager
def _scoped_patch(owner, attribute: str, make_replacement, uses, needle: str, name: str, does: str):
    """Within the block, on a host without CUDA, `owner.attribute` is `make_replacement(original)`; restored on
    exit. Does nothing where CUDA is used. Raises MegatronShimError first when the source of `uses` (the
    Megatron code the patch is for, which `does` something) no longer contains `needle`."""
    if use_cuda():
        yield
        return
    if needle not in inspect.getsource(uses):
        raise MegatronShimError(f"CPU shim: {uses.__qualname__} no longer {does} ({needle!r} is gone); {name} may "
                                "be obsolete — review moe/cpu_shim.py")
    original = getattr(owner, attribute)
    setattr(owner, attribute, make_replacement(original))
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def tensor_cuda_as_identity():
    """Within the block, on a host without CUDA, `Tensor.cuda()` returns the tensor itself (CPU stays CPU)
    instead of raising; restored on exit. Does nothing where CUDA is available. Checks that Megatron still
    makes the call it is for (LanguageModule.setup_embeddings_and_output_layer, tied embeddings at PP > 1)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return _scoped_patch(torch.Tensor, "cuda", lambda original: lambda self, *args, **kwargs: self,
                         LanguageModule.setup_embeddings_and_output_layer, "weight.data.cuda()",
                         "tensor_cuda_as_identity", "calls weight.data.cuda()")


class _CpuFactoriesTorch:
    """torch as Megatron's optimizer modules see it on a CUDA-less host: the tensor factories they call with
    device='cuda' make CPU tensors; every other name is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(kwargs: dict) -> dict:
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._on_cpu(kwargs))

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._on_cpu(kwargs))

    def empty(self, *args, **kwargs):
        return torch.empty(*args, **self._on_cpu(kwargs))

    def ones(self, *args, **kwargs):
        return torch.ones(*args, **self._on_cpu(kwargs))


def _l2_norm_on_grad_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron.core.utils.local_multi_tensor_l2_norm's math (the L2 norm over every tensor of every list) as a
    float32 [1] tensor on the tensors' device instead of 'cuda'."""
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    if not norms:
        return torch.zeros(1, dtype=torch.float32), None
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor"}


def _cuda_type_names(original):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


def cuda_tensor_types():
    """Within the block, on a host without CUDA, `Tensor.type()` (no argument) names CPU float32 / bfloat16 /
    float16 tensors by their CUDA type names, so that Megatron's optimizer accepts CPU parameters and
    gradients; `Tensor.type(dtype)` and every other call are unchanged; restored on exit. Does nothing where
    CUDA is used. Checks that the distributed optimizer still makes the check it is for."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return _scoped_patch(torch.Tensor, "type", _cuda_type_names, DistributedOptimizer._build_model_and_main_param_groups,
                         "'torch.cuda.BFloat16Tensor'", "cuda_tensor_types",
                         "checks param.type() against CUDA type names")


def _config_without_sequence_parallel(config):
    import copy

    clone = copy.copy(config)
    clone.sequence_parallel = False
    return clone


def initialize_cpu_rng(seed: int) -> None:
    """Seed torch and install Megatron's RNG tracker in the form that works without CUDA.

    `model_parallel_cuda_manual_seed` needs CUDA; a CPU RNG-state tracker makes DP-replicated weights
    differ between EP ranks, the inference (no-op) tracker keeps them identical (docs/platform.md).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class _ScheduleTorch:
    """torch as Megatron's pipeline schedules see it on a CUDA-less host: `torch.zeros(..., device="cuda")`
    (their token counter) is made on the CPU; every other name is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def pipeline_schedule_on_cpu():
    """Within the block, on a host without CUDA, Megatron's pipeline schedules (`schedules.py`) build their
    token counter (`torch.zeros([], device="cuda")`) on the CPU; restored on exit. Does nothing where CUDA is
    available. Checks that the schedules still make that call."""
    from megatron.core.pipeline_parallel import schedules

    return _scoped_patch(schedules, "torch", lambda original: _ScheduleTorch(),
                         schedules.forward_backward_pipelining_without_interleaving,
                         'torch.zeros([], dtype=torch.int, device="cuda")', "pipeline_schedule_on_cpu",
                         "builds its token counter on 'cuda'")
