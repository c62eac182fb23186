"""The frozen KL reference policy's weights on disk (rl.kl.coef > 0): `<run>/reference.safetensors`.

The reference is the policy at the start of RL (after cold-start SFT / model.init_from) and never changes,
so it is written once, before the step_000000 checkpoint, and read back on every resume (the step_X
checkpoints hold the moving policy only, and the oldest are pruned). Same protocol as the checkpoints:
    reference.safetensors   full TP=EP=1 state dict (safetensors), written to a .tmp name, fsynced, renamed
    reference.json          {"bytes", "sha256", "run_id"}, written the same way AFTER the weights
A reader trusts nothing: size and sha256 are re-checked, and the run id must be the resumed run's (a stale
file of an earlier run with the same name is refused, never silently used as the reference).
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

from moe.hf_checkpoint import all_finite
from moe.json_files import JsonFileError, read_json

from .guards import load_safetensors
from .store import CheckpointError, _fsync_path, sha256_file

REFERENCE = "reference.safetensors"
REFERENCE_META = "reference.json"


def _atomic_write(path: str, write) -> None:
    from safetensors import SafetensorError

    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        try:
            write(tmp)
        except SafetensorError as exc:  # safetensors reports a full disk / quota this way, not as OSError
            raise OSError(f"{tmp}: {exc}") from None
        _fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.isfile(tmp):
            os.remove(tmp)
    _fsync_path(os.path.dirname(os.path.abspath(path)))


def save_reference(run_dir: str, state: Dict[str, torch.Tensor], run_id: str) -> str:
    """Write the reference weights and their manifest atomically (rank 0 only). -> the weights' path."""
    from safetensors.torch import save_file

    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, REFERENCE)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    _atomic_write(path, lambda p: save_file(tensors, p))
    meta = {"bytes": os.path.getsize(path), "sha256": sha256_file(path), "run_id": run_id}

    def dump(p):
        with open(p, "w") as f:
            json.dump(meta, f)

    _atomic_write(os.path.join(run_dir, REFERENCE_META), dump)
    return path


def load_reference(run_dir: str, run_id: str) -> Dict[str, torch.Tensor]:
    """The verified reference weights of this run; CheckpointError naming what is wrong otherwise."""
    return load_safetensors(verify_reference(run_dir, run_id))


def verify_reference(run_dir: str, run_id: str) -> str:
    """Size, sha256 and run id of <run_dir>/reference.safetensors against its manifest. -> its path;
    CheckpointError naming what is wrong otherwise."""
    path = os.path.join(run_dir, REFERENCE)
    meta_path = os.path.join(run_dir, REFERENCE_META)
    if not os.path.isfile(path) or not os.path.isfile(meta_path):
        raise CheckpointError(f"rl.kl.coef > 0 but the KL reference weights {path} (and {REFERENCE_META}) are "
                              "missing: they are written at the start of RL; this run cannot be resumed with a KL "
                              "penalty (start a fresh run, or resume with rl.kl.coef=0)")
    try:
        meta = read_json(meta_path)
        want_bytes, want_sha, want_id = int(meta["bytes"]), str(meta["sha256"]), meta.get("run_id")
    except JsonFileError as exc:
        raise CheckpointError(str(exc)) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{meta_path} is unreadable ({type(exc).__name__}: {exc})") from None
    if want_id != run_id:
        raise CheckpointError(f"{path} belongs to run {want_id!r}, not to the resumed run {run_id!r}: refusing a "
                              "stale KL reference")
    size = os.path.getsize(path)
    if size != want_bytes:
        raise CheckpointError(f"{path} has {size} bytes, {REFERENCE_META} says {want_bytes} (truncated?)")
    if sha256_file(path) != want_sha:
        raise CheckpointError(f"{path}: sha256 differs from {REFERENCE_META} (corrupt)")
    bad = first_nonfinite_tensor(path)
    if bad:
        raise CheckpointError(f"{path}: tensor {bad} holds NaN or infinite values: a KL penalty against it would "
                              "be NaN; this run cannot be resumed with a KL penalty (start a fresh run, or resume "
                              "with rl.kl.coef=0)")
    return path


def first_nonfinite_tensor(path: str):
    """The name of the first floating-point tensor of the safetensors file `path` holding a NaN or an infinity
    (None when all are finite), read one tensor at a time and checked with one aminmax each
    (moe.hf_checkpoint.all_finite): the checksums only say the file is the one its record names."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in sorted(handle.keys()):
                if not all_finite(handle.get_tensor(name)):
                    return name
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
    return None
