"""Full-state checkpoint files: the whole (TP=EP=PP=1) model in one weights-only torch file (`checkpoint.pt`,
`cold_start.pt`), written atomically at the end of a run and after cold-start SFT, and the one reader of every
form `megagspo export` and `model.init_from` accept (that file, a verified step_XXXXXX folder or run folder,
or a bare .safetensors state)."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from megagspo.errors import write_failure_message
from moe.hf_checkpoint import all_finite

from .guards import load_safetensors, safe_torch_load
from . import store
from .state import load_run_checkpoint
from .store import CheckpointError


def save_full_checkpoint(path: str, state: dict, arch, tokenizer: str, config: dict, intact: str) -> None:
    """Write {"state", "arch", "tokenizer", "config"} to `path` through a temporary name and a rename, so a
    crash never leaves a half-written file; a failure names its cause (disk full, ...) and says that the
    step checkpoints under `intact` are untouched."""
    try:
        torch.save({"state": state, "arch": arch.__dict__, "tokenizer": tokenizer, "config": config}, path + ".tmp")
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        reason = write_failure_message(exc, path)
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise CheckpointError(f"writing {path} failed: {reason}; the step checkpoints under {intact} are intact") \
            from None


def save_full_weights(dims, policy, path: str, arch, tokenizer: str, config: dict, intact: str) -> Optional[str]:
    """Collective: the full (TP=EP=PP=1) weights of `policy` (every rank gathers: moe.parallel.ParallelDims
    `dims`, a MegatronPolicy) written by global rank 0 as `path` (save_full_checkpoint); a failed write stops
    every rank together. -> `path` on rank 0, None elsewhere."""
    state = policy.full_state_dict()  # collective under EP: every rank calls it
    dims.on_rank0(f"writing {os.path.basename(path)}",
                  lambda: save_full_checkpoint(path, state, arch, tokenizer, config, intact=intact))
    return path if dims.is_main else None


def load_checkpoint(path: str, say=print) -> dict:
    """{"state": full Megatron state, "arch", "tokenizer", "config"} from checkpoint.pt (weights-only), a
    verified checkpoint folder step_XXXXXX / checkpoints folder / run folder (sharded), or a bare .safetensors
    file (state only). Raises CheckpointError naming the path and the problem.

    A folder means what --resume makes of it (state.resolve_checkpoint): its newest intact step checkpoint.
    A run folder's checkpoint.pt is read only when the folder holds no step checkpoint (a run without RL) and
    was written by the run that wrote config.yaml (every run, fresh or resumed, rewrites config.yaml at its
    start; a fresh run moves an earlier run's checkpoint.pt aside): an older one is a leftover of an earlier
    run and is refused."""
    if os.path.isdir(path):
        if holds_step_checkpoints(path):  # load_run_checkpoint verifies them (once: the finite scan reads every shard)
            return load_run_checkpoint(path, say)
        full = os.path.join(path, "checkpoint.pt")
        if not os.path.isfile(full):
            return load_run_checkpoint(path, say)  # its error names what a folder may hold
        config_yaml = os.path.join(path, "config.yaml")
        if os.path.isfile(config_yaml) and os.path.getmtime(full) < os.path.getmtime(config_yaml):
            raise CheckpointError(f"{full} is older than {config_yaml}: it was left by an earlier run of this "
                                  "folder, and the run started since has written no checkpoint yet; pass the "
                                  "file itself to use it anyway")
        path = full
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path!r}")
    if path.endswith(".safetensors"):
        ckpt = {"state": load_safetensors(path)}
    else:
        ckpt = safe_torch_load(path)  # weights_only=True: never unpickles code from a user path
    state = ckpt.get("state") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                              for k, t in state.items()):
        raise CheckpointError(f"{path}: not a megagspo checkpoint (expected {{'state': {{name: tensor}}, ...}})")
    require_finite(path, state)
    return ckpt


def holds_step_checkpoints(path: str) -> bool:
    """Whether the folder `path` is a step checkpoint or holds some (itself or under checkpoints/), intact or
    not: the cases state.resolve_checkpoint answers, told apart from a listing alone."""
    return os.path.isfile(os.path.join(path, store.MANIFEST)) or \
        any(store.list_checkpoints(root) for root in (path, os.path.join(path, "checkpoints")))


class NonFiniteCheckpoint(CheckpointError):
    """A checkpoint file that reads cleanly but holds NaN or infinite weights."""


def require_finite(path: str, state: dict) -> None:
    """NonFiniteCheckpoint naming the file and the first tensors when any floating-point tensor of `state`
    holds a NaN or an infinity (one aminmax per tensor: moe.hf_checkpoint.all_finite). A step checkpoint
    folder is checked the same way, chunk by chunk, before it is chosen (state.check_run_checkpoint), so an
    older one is taken instead; a single file has nothing older to fall back to."""
    bad = [name for name, t in state.items() if not all_finite(t)]
    if bad:
        raise NonFiniteCheckpoint(f"{path}: {len(bad)} tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
                                  f"{', ...' if len(bad) > 3 else ''}); a model cannot start from non-finite weights")
