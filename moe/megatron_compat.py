"""Megatron-Core 0.16.1 bugs that bite on every device, handled by one explicit, logged step.

`apply_megatron_compat()` is called by `moe.model.build_model` before any model exists, on CPU and GPU alike
(the CPU shim calls it as well). It changes one thing today:

- `moe_utils.RouterGatingLinearFunction.forward` calls `te_general_gemm` when its inputs are not float32,
  and `moe_utils` binds that name only when Transformer Engine imports: without TE, every MoE router forward
  raises `NameError: name 'te_general_gemm' is not defined` (on CUDA always, since Megatron checks for the
  name before the dtype; fixed upstream in megatron-core 0.17.0 by binding it to None). Bound to None here,
  which selects the torch GEMM. With Transformer Engine installed the name exists and nothing is changed.

- `DistributedOptimizer._set_main_param_and_optimizer_states` (loading a `fully_reshardable` optimizer
  checkpoint) copies every key of the torch optimizer's per-parameter state from the loaded tensors; with
  torch's own Adam (no TE / apex, so on our GPU hosts too) that state holds `step`, which the loaded tensors
  never carry (the step travels in the param groups and `load_state_dict` has already restored it), so every
  resume raises `KeyError: 'step'`. Replaced by the same copy that leaves `step` alone.

Each patched symbol is checked against its Megatron-Core 0.16.1 signature and source before it is changed.
Nothing happens on import; the second call changes nothing.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

_APPLIED: list[str] = []  # the changes made, once applied
_DONE = [False]


class MegatronCompatError(RuntimeError):
    """Megatron-Core changed under a compatibility step: the message names the step to review."""


def apply_megatron_compat() -> list[str]:
    """Apply (once) and return a line per change made; logs each line."""
    if _DONE[0]:
        return list(_APPLIED)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    changes: list[str] = []
    if not hasattr(moe_utils, "te_general_gemm"):
        forward = getattr(getattr(moe_utils, "RouterGatingLinearFunction", None), "forward", None)
        if forward is None or "te_general_gemm" not in inspect.getsource(forward):
            raise MegatronCompatError(
                "megatron moe_utils.RouterGatingLinearFunction.forward no longer references te_general_gemm: "
                "the te_general_gemm compatibility step may be obsolete — review moe/megatron_compat.py")
        moe_utils.te_general_gemm = None
        changes.append("megatron moe_utils.te_general_gemm = None (Transformer Engine absent; megatron-core "
                       "0.16.1 raises NameError in the MoE router otherwise)")
    changes.extend(_fix_optimizer_step_on_load())
    for line in changes:
        logger.warning("megagspo Megatron compat: %s", line)
    _APPLIED.extend(changes)
    _DONE[0] = True
    return list(_APPLIED)


_SET_STATES_SIGNATURE = "(self, model_param, tensors)"
_SET_STATES_SOURCE = 'dst_tensors = {"param": main_param, **optim_state}'


def _fix_optimizer_step_on_load() -> list[str]:
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
        return []  # fused Adam keeps no per-parameter step: nothing to fix
    cls = distrib_optimizer.DistributedOptimizer
    original = getattr(cls, "_set_main_param_and_optimizer_states", None)
    if original is None or str(inspect.signature(original)) != _SET_STATES_SIGNATURE \
            or _SET_STATES_SOURCE not in inspect.getsource(original):
        raise MegatronCompatError(
            "megatron DistributedOptimizer._set_main_param_and_optimizer_states changed: the optimizer-step load "
            "fix may be obsolete — review moe/megatron_compat.py")

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        for key, destination in destinations.items():
            if key != "step":  # restored from the param groups by load_state_dict; never among `tensors`
                destination.copy_(tensors[key])

    _set_main_param_and_optimizer_states.__megagspo_original__ = original
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    return ["megatron DistributedOptimizer._set_main_param_and_optimizer_states leaves torch Adam's 'step' to "
            "load_state_dict (megatron-core 0.16.1 raises KeyError: 'step' on every optimizer load without TE/apex)"]
