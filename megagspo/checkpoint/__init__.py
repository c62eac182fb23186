"""Checkpoints that never lose a run: atomic, checksummed, verified-before-load checkpoint folders with
fallback to the previous good one, exact resume, preemption signals, and safe readers for user paths.

    store.py    folder protocol (tmp name -> rename, manifest written last, sha256), verify, fallback, prune
    state.py    what a training checkpoint holds (model / optimizer as Megatron dist_checkpointing shards, via
                moe.dist_checkpoint); CheckpointManager (save / find_resume / restore)
    parts.py    the state-dict parts in one ordered table, restored in one pass (restore_parts)
    signals.py  SIGTERM / SIGINT -> finish the step, checkpoint, exit 128+signal; second signal exits at once
    guards.py   safetensors / weights-only torch readers; verifier time limit
    reference.py the frozen KL reference policy's weights (<run>/reference.safetensors, written once, verified)
"""

from .guards import VerifierTimeout, load_safetensors, safe_torch_load, with_time_limit
from .reference import REFERENCE, load_reference, save_reference, verify_reference
from .signals import Preempted, StopRequest
from .state import REQUIRED, CheckpointManager, load_run_checkpoint
from .store import CheckpointError, latest_good, list_checkpoints, prune, verify, write_checkpoint

__all__ = ["REFERENCE", "REQUIRED", "CheckpointError", "CheckpointManager", "Preempted", "StopRequest",
           "VerifierTimeout", "latest_good", "list_checkpoints", "load_reference", "load_run_checkpoint",
           "load_safetensors", "prune", "safe_torch_load", "save_reference", "verify", "verify_reference", "with_time_limit",
           "write_checkpoint"]
