"""The frozen KL reference policy (rl.kl_coef > 0): its weights are the policy's at the start of RL, written
once to <run>/reference.safetensors (atomic, checksummed) so that a resume uses the same reference."""

from __future__ import annotations

import os


def start_reference(trainer) -> None:
    """Collective: reference := the policy's full state now (start of RL); rank 0 writes it to
    <run>/reference.safetensors (atomic, checksummed) so that a resume gets the same reference."""
    full = trainer.policy.full_state_dict()
    trainer.reference.load_full_state_dict(full)
    _save_on_rank0(trainer, trainer.cfg.run_dir(), full, "writing the KL reference weights under")
    trainer._reference_ready = True


def _save_on_rank0(trainer, run_dir: str, full: dict, what: str) -> None:
    """Collective: rank 0 writes the reference; a failure (disk full, quota) stops every rank together."""
    from megagspo.checkpoint import CheckpointError, save_reference

    def write():
        try:
            save_reference(run_dir, full, trainer.ckpt.run_id)
        except OSError as exc:
            from megagspo.errors import os_error_message

            raise CheckpointError(f"{what} {run_dir} failed: {os_error_message(exc)}") from None

    trainer._from_rank0("the KL reference write", write)


def resume_reference(trainer) -> None:
    """Collective: the reference weights of the run the resumed checkpoint belongs to (its folder may be
    another run's: checkpoint.resume can name one). Rank 0 verifies size, sha256 and run id once and
    shares the verdict (no rank is left in a collective when the file is bad); every rank then loads
    its shards. A reference read from another run's folder is copied into this run's."""
    from megagspo.checkpoint import CheckpointError, load_safetensors, verify_reference

    # <run>/checkpoints/step_XXXXXX -> <run>
    source_dir = os.path.dirname(os.path.dirname(os.path.abspath(trainer.resume["path"])))
    path = trainer._from_rank0("the KL reference check", lambda: verify_reference(source_dir, trainer.ckpt.run_id))
    full = load_safetensors(path)
    try:
        trainer.reference.load_full_state_dict(full)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"the KL reference weights {path} do not fit this model: {exc}") from None
    here = os.path.abspath(trainer.cfg.run_dir())
    if source_dir != here:
        _save_on_rank0(trainer, here, full, "copying the KL reference weights into")
    trainer._reference_ready = True
