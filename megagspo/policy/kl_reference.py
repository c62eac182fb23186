"""The frozen KL reference policy (rl.kl.coef > 0): its weights are the policy's at the start of RL, written
once to <run>/reference.safetensors (atomic, checksummed) so that a resume uses the same reference.

`KLReference` owns its model (a frozen MegatronPolicy of the run's layout) and whether its weights are set
(`ready`); it is built from the process layout, that model, the run folder and the run id."""

from __future__ import annotations

import os

from megagspo.checkpoint import CheckpointError, load_safetensors, save_reference, verify_reference
from megagspo.errors import os_error_message
from megagspo.policy.megatron_policy import MegatronPolicy
from moe.parallel import ParallelDims


class KLReference:
    def __init__(self, dims: ParallelDims, policy: MegatronPolicy, run_dir: str, run_id: str) -> None:
        self.dims = dims
        self.policy = policy          # frozen: no gradients, no routing replay (it routes with its own router)
        self.run_dir = run_dir
        self.run_id = run_id
        self.ready = False            # its weights are the start of RL (start_from or resume has run)

    def logprobs(self, inputs: list) -> list:
        """log pi_ref of each micro-batch input (its own router: never replaying), as run_micro_batches returns
        them (None on stages without the LM head)."""
        return self.policy.run_micro_batches(inputs)

    def start_from(self, policy: MegatronPolicy) -> None:
        """Collective: reference := `policy`'s full state now (start of RL); rank 0 writes it to
        <run>/reference.safetensors (atomic, checksummed) so that a resume gets the same reference."""
        full = policy.full_state_dict()
        self.policy.load_full_state_dict(full)
        self._save_on_rank0(self.run_dir, full, "writing the KL reference weights under")
        self.ready = True

    def resume(self, checkpoint_path: str) -> None:
        """Collective: the reference weights of the run the resumed checkpoint belongs to (its folder may be
        another run's: checkpoint.resume can name one). Rank 0 verifies size, sha256 and run id once and
        shares the verdict (no rank is left in a collective when the file is bad); every rank then loads
        its shards. A reference read from another run's folder is copied into this run's."""
        # <run>/checkpoints/step_XXXXXX -> <run>
        source_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_path)))
        path = self.dims.on_rank0("the KL reference check", lambda: verify_reference(source_dir, self.run_id))
        full = load_safetensors(path)
        try:
            self.policy.load_full_state_dict(full)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"the KL reference weights {path} do not fit this model: {exc}") from None
        here = os.path.abspath(self.run_dir)
        if source_dir != here:
            self._save_on_rank0(here, full, "copying the KL reference weights into")
        self.ready = True

    def _save_on_rank0(self, run_dir: str, full: dict, what: str) -> None:
        """Collective: rank 0 writes the reference; a failure (disk full, quota) stops every rank together."""
        def write():
            try:
                save_reference(run_dir, full, self.run_id)
            except OSError as exc:
                raise CheckpointError(f"{what} {run_dir} failed: {os_error_message(exc)}") from None

        self.dims.on_rank0("the KL reference write", write)
