"""`model.init_from`: the run's starting weights, checked against the model before any compute, then loaded.

A Hugging Face folder (config.json + safetensors, one file or sharded with its index) is checked from its
headers alone, and each rank later reads only the slices it owns (`moe.hf_checkpoint.load_hf_checkpoint`),
cast to the run's precision. A megagspo checkpoint (`checkpoint.pt`, a `step_XXXXXX` folder, a run folder
or a bare `.safetensors` state) holds the full state of a small run and is read once here. The dry run and
the trainer share `preflight_init_from`, so a recipe that passes the dry run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megagspo.checkpoint.full_state import NonFiniteCheckpoint, load_checkpoint
from megagspo.config import ConfigError
from megagspo.errors import first_line, os_error_message
from moe.architecture import ArchitectureError
from moe.collective import collective_device
from moe.hf_checkpoint import CheckpointError, inspect_hf_checkpoint, load_hf_checkpoint


# Training-time fields a checkpoint may carry with other values than the run (as in the HF config check).
_NOT_COMPARED = ("initializer_range", "router_aux_loss_coef", "max_position_embeddings")


@dataclass
class InitSource:
    kind: str  # "random" | "hf" | "megagspo"
    path: str
    description: str  # one line for the dry run and the start-up log
    full_state: Optional[dict] = None  # megagspo checkpoints: their full (TP=EP=PP=1) state, read by the preflight


def preflight_init_from(model_cfg, arch) -> InitSource:
    """Check model.init_from against `arch` without touching the model; ConfigError names what does not fit
    (each missing or wrongly shaped tensor with both shapes, or each differing config.json field)."""
    path = model_cfg.init_from
    if not path:
        return InitSource("random", "", "random init")
    if model_cfg.init_from_hf():
        try:
            layout, shapes = inspect_hf_checkpoint(path, arch)
        except (CheckpointError, ArchitectureError, OSError) as exc:
            raise ConfigError(f"model.init_from = {path!r} does not fit this model: {exc}") from None
        return InitSource("hf", path, f"{path}: {len(shapes)} Hugging Face tensors match the architecture "
                                      f"({layout} experts); each rank reads only its slices")
    try:
        ckpt = load_checkpoint(path)  # every tensor checked finite (NaN / inf), a step checkpoint before it is chosen
    except NonFiniteCheckpoint as exc:
        raise ConfigError(f"model.init_from = {path!r}: {exc}") from None
    except CheckpointError as exc:
        raise ConfigError(f"model.init_from = {path!r}: {exc} (or a Hugging Face folder: config.json with "
                          "model.safetensors or model.safetensors.index.json)") from None
    saved_arch = ckpt.get("arch")
    if saved_arch:
        differ = [f"{k}: checkpoint {v!r}, model {getattr(arch, k)!r}" for k, v in saved_arch.items()
                  if hasattr(arch, k) and k not in _NOT_COMPARED
                  and _as_tuple(v) != _as_tuple(getattr(arch, k))]
        if differ:
            raise ConfigError(f"model.init_from = {path!r} holds another architecture: " + "; ".join(differ))
    return InitSource("megagspo", path, f"{path}: megagspo checkpoint ({len(ckpt['state'])} tensors)",
                      full_state=ckpt["state"])


def _as_tuple(value):
    return tuple(value) if isinstance(value, list) else value


def load_init_weights(policy, source: InitSource, arch) -> None:
    """Collective: copy the checked starting weights into this rank's part of `policy`'s model. A read that
    fails on any rank (an I/O error, a file changed since the preflight) fails on every rank together."""
    failure = ""
    try:
        _load(policy, source, arch)
    except (ConfigError, OSError, RuntimeError) as exc:
        failure = str(exc) if isinstance(exc, ConfigError) else \
            f"model.init_from = {source.path!r} could not be read: {_one_line(exc)}"
    if _failed_anywhere(bool(failure)):
        raise ConfigError(failure or f"model.init_from = {source.path!r} could not be read on another rank")


def _load(policy, source: InitSource, arch) -> None:
    if source.kind == "random":
        return
    if source.kind == "hf":
        try:
            load_hf_checkpoint(policy.model, source.path, arch)
        except CheckpointError as exc:
            raise ConfigError(f"model.init_from = {source.path!r} does not fit this model: {exc}") from None
        return
    try:
        policy.load_full_state_dict(source.full_state)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"model.init_from = {source.path!r} does not fit this model: {exc}") from None
    source.full_state = None  # the policy holds the weights now


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return os_error_message(exc)
    return f"{type(exc).__name__}: {first_line(exc)}"


def _failed_anywhere(failed: bool) -> bool:
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
