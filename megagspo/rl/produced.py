"""The trainer's side of the rollout producer process (`rollout.staleness: N` with `rollout.producer: process`):
batch k was generated with the policy version max(k - N, start) by a process of its own (megagspo.rl.producer),
scored there (dynamic sampling's rounds included), and waits in a queue of at most N batches.

The model-parallel rank 0 of each data-parallel rank talks to its producer and shares the batch with its TP x PP
peers, as generation does. After each update the weights go to the producer, streamed in the engine link's buckets
(a collective, on every rank); the trainer's own engine is only marked behind (EngineLink.mark_behind): the
held-out evaluation, its only reader, streams the weights to it when it runs, so a step streams the model once.
The source's state (the batches received and not consumed, the producer's state after the last of them) is what a
checkpoint holds, under its own key.

Legend (docs/architecture.md): R responses of this data-parallel rank.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from megagspo.checkpoint.state import AHEAD, PRODUCED
from megagspo.config_training import GroupAdvantageConfig
from megagspo.data.datasets import PromptDataset
from megagspo.policy.engine_link import EngineLink
from megagspo.rl.batch_maker import filter_metrics, scores_of
from megagspo.rl.producer import ProducedBatch, ProducerSpec
from megagspo.rl.producer_process import ProducerProcess
from megagspo.rl.source_protocol import SourceCheckpoint, SourcedBatch
from megagspo.rl.staleness import token_staleness
from moe.parallel import ParallelDims


class Produced:
    """The rollout source of the producer process (megagspo.rl.sources' protocol)."""

    def __init__(self, dims: ParallelDims, spec: ProducerSpec, prompts: PromptDataset,
                 advantage: GroupAdvantageConfig, link: EngineLink) -> None:
        self.dims, self.spec, self.prompts, self.advantage, self.link = dims, spec, prompts, advantage, link
        self.producer = ProducerProcess(spec, prompts) if dims.generates else None
        self.version: Optional[int] = None     # the policy version the trainer holds; None: not started
        self.held: deque = deque()             # ProducedBatch received (or restored), not yet consumed
        self.next_index = 0                    # the next batch to receive from the producer
        self.resume_state: Optional[dict] = None
        self.checkpoint = SourceCheckpoint(
            "producer", PRODUCED, self,
            note="the batches produced ahead are not restored; the producer starts from the checkpoint's weights",
            legacy=(("rollouts_ahead", AHEAD),))  # where ec55d2c filed it

    # ---- the protocol ---------------------------------------------------------------------------------------
    def next(self, step: int) -> SourcedBatch:
        if self.version is None:
            self._start(step)
        t0 = time.perf_counter()
        batch, depth = self.dims.on_mp_rank0("rollouts from the producer", lambda: self._take(step))
        wait_s = time.perf_counter() - t0
        scored = batch.scored
        metrics = token_staleness(self.dims, scored.rollouts.out, batch.version, step, self.spec.rollout.partial)
        # the producers' peak (each DP rank has its own), where every one was measured (a restored batch was not)
        peaks = [p for (p,) in self.dims.dp_gather([-1.0 if batch.peak_gib is None else batch.peak_gib])]
        if min(peaks) >= 0:
            metrics["memory/producer_peak_gib"] = max(peaks)
        if self.spec.filter.enabled:
            metrics.update(filter_metrics(scored.filter, self.spec.batch.prompts_per_step, self.dims.dp_sum,
                                          self.dims.dp_gather))
        times = {"time/rollout_s": scored.rollout_s, "time/reward_s": scored.reward_s,
                 "time/producer_idle_s": batch.idle_s, "time/trainer_wait_s": wait_s,
                 # the batches ready behind this one when the step asked (at most N); timing-dependent (how far the
                 # producer got), hence among the time/ entries
                 "time/queue_depth": float(depth)}
        scores = scores_of(scored.rewards_R, scored.stats, self.spec.batch.group_size, self.advantage)
        return SourcedBatch(scored.rollouts, scores, metrics, times)

    def _start(self, step: int) -> None:
        """Start the producer where the run is: the restored state, or batch `step` from the current weights and the
        prompt stream's current position (fresh start; a checkpoint that held no producer state). Collective (the
        weights are streamed)."""
        self.version = step
        state = self.resume_state or {"next": step, "floor": step, "dataset": self.prompts.state_dict(),
                                      "generator": None}
        self.next_index = state["next"]
        if self.producer is not None:
            self.producer.start(state)
        self._send_weights()

    def after_update(self, link: EngineLink) -> dict:
        """The weights after this update (version + 1) to the producer, when a batch still to come needs them; the
        trainer's own engine is left behind until something reads it."""
        self.version += 1
        link.mark_behind()
        if self.spec.version_for(self.spec.steps - 1, 0) < self.version:
            return {}
        t0 = time.perf_counter()
        self._send_weights()
        return {"time/producer_sync_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()

    # ---- inside -----------------------------------------------------------------------------------------------
    def _send_weights(self) -> None:
        self.link.stream_copies(self.version, None if self.producer is None else self.producer.send_weights)

    def _receive(self) -> None:
        self.held.append(self.producer.take(self.next_index))
        self.next_index += 1

    def _take(self, step: int):
        ready = len(self.held) + self.producer.depth()
        if not self.held:
            self._receive()
        batch = self.held.popleft()
        depth = max(ready - 1, 0)  # scored batches ready behind this one: at most N (the weights gate the producer)
        if batch.index != step:
            raise RuntimeError(f"rollout producer: step {step} was given batch {batch.index} (a checkpoint of another "
                               "run or rl.steps?)")
        return batch, depth

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The batches received and not consumed, after waiting for every batch generated with weights older than
        the current ones (a resumed run has only these), and the producer's state after the last of them, as
        {"tensors": {...}, "meta": JSON-able}; None before the producer started and on ranks without one."""
        if self.version is None or self.producer is None:
            return None
        while self.next_index < self.spec.steps and \
                self.spec.version_for(self.next_index, self.producer.start_state["floor"]) < self.version:
            self._receive()
        tensors, batches = {}, []
        for i, batch in enumerate(self.held):
            state = batch.state_dict()
            tensors.update({f"b{i}/{name}": t for name, t in state["tensors"].items()})
            batches.append(state["meta"])
        state = dict(self.producer.start_state)
        generator = state.pop("generator", None)
        if generator is not None:
            tensors["generator"] = generator
        return {"tensors": tensors, "meta": {"kind": "producer", "batches": batches, "state": state}}

    def load_state_dict(self, tensors: dict, meta: dict) -> None:
        """Hold the checkpoint's batches again; the producer restarts from the state after the last of them."""
        if meta.get("kind") != "producer":  # an ec55d2c checkpoint of rollout.producer = thread, under the old key
            print("the checkpoint's batch generated ahead comes from rollout.producer = thread: the producer starts "
                  "from the checkpoint's weights (the run continues; it is not a bit-for-bit replay)", flush=True)
            return
        self.held.clear()
        for i, b in enumerate(meta["batches"]):
            prefix = f"b{i}/"
            self.held.append(ProducedBatch.from_state(
                {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, b))
        self.resume_state = dict(meta["state"], generator=tensors.get("generator"))


__all__ = ["Produced", "ProducedBatch"]
