"""One-step-off asynchronous rollouts (`rollout.staleness: 1`): the engine generates batch n+1 while the trainer
updates on batch n, so generation and training overlap instead of waiting for each other.

Legend: R = B G responses of this data-parallel rank, L response length.

Timeline of RL step n (`RLStep.__call__`): take batch n (generated during step n-1, or now at the first step and
after a resume that holds none); draw the prompts of batch n+1 from the stream and start generating them on a
background thread with the engine's CURRENT weights, those after update n-1; score, recompute pi_old and
update on batch n; wait for batch n+1; only then stream the weights after update n to the engine. So batch n+1
comes from the policy one update older than the one it trains, pi_old is the policy before the update
(recomputed), and the engine's per-token log-probs are the behaviour policy: the gap between the two is what
`rl.old_policy.correction.method` acts on and the mismatch/* metrics show. Staleness 0 is the synchronous step, bit for
bit (the draws of the prompt stream come in the same order either way).

Why a thread, not a process: the embedded engine is a transformers model in this process, holding its own
copy of the weights (the weight sync writes into it), so a thread shares it with no copy and no IPC, and its
kernels release the GIL; SGLang is a server, so the thread only waits on HTTP. The engine is used by one thread
at a time (evaluation and the weight sync run after the wait). Its sampling would draw from the global torch
generator, but Megatron's RNG tracker saves and restores the global generators around parts of its forward, which
would overwrite the draws of a generation running beside it, so the embedded engine samples batches generated
ahead from a generator of its own (`RolloutEngine.seeded_generator`: greedy decoding over Gumbel-perturbed
warped logits, the same distribution as `do_sample`), seeded from the run's seed and checkpointed with the
batch; the run stays a function of the seed. Only where generation needs no collective:
without tensor / pipeline parallelism (under TP x PP the generating rank broadcasts to its peers, a
collective that must not run beside the training thread's).

Partial rollouts (`rollout.partial: true`, any engine, SGLang's path to them): the weights after update n no
longer wait for batch n+1. The step streams them (the collective, on the training thread) into `HandedWeights`,
which the generating thread's engine asks between decoding steps (SGLang: between abort and resume); the
responses still unfinished continue under them, each token tagged with its version. If the batch was done first,
the training thread loads them itself after the wait, so the engine always enters step n+1 with the weights after
update n, as without partial rollouts.

Checkpoints stay exact: a checkpoint after step n holds batch n+1, complete (the step waited for it), in
`rollouts_ahead.safetensors` and the trainer state; a resume takes it as its first batch, with the weights
after update n streamed to the engine for batch n+2, as the uninterrupted run did.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from megagspo.rl.batch_maker import Rollouts


class HandedWeights:
    """The WeightSwitch of partial rollouts on the one-step-ahead thread: the training thread hands over the weights
    after its update (`hand`, buckets it owns), the generating thread's engine loads them at its next check."""

    def __init__(self, version: int = 0) -> None:
        self.version = version            # the version the engine holds
        self._handed: Optional[tuple] = None
        self._lock = threading.Lock()

    def hand(self, version: int, buckets: list) -> None:
        with self._lock:
            self._handed = (version, buckets)

    def pending(self) -> bool:
        return self._handed is not None

    def apply(self, engine) -> int:
        with self._lock:
            version, buckets = self._handed
            self._handed = None
            engine.update_weights_from_buckets(buckets)
            self.version = version
        return version


class RolloutsAhead:
    """The batch being generated (or generated) ahead of the step that trains on it."""

    def __init__(self, generate: Callable[[list], Rollouts], generator: Optional[torch.Generator] = None) -> None:
        self._generate = generate            # prompts -> Rollouts (this rank's share, the engine's output)
        self.generator = generator           # the engine's sampling generator (None: the engine samples elsewhere)
        self._thread: Optional[threading.Thread] = None
        self._prompts: Optional[list] = None
        self._rollouts: Optional[Rollouts] = None
        self._error: Optional[BaseException] = None

    @property
    def holds_batch(self) -> bool:
        return self._prompts is not None

    def launch(self, prompts: list) -> None:
        """Start generating `prompts` on a background thread with the engine's current weights."""
        if self.holds_batch:
            raise RuntimeError("RolloutsAhead.launch: the previous batch was not taken")
        self._prompts, self._rollouts, self._error = prompts, None, None

        def run():
            try:
                self._rollouts = self._generate(prompts)
            except BaseException as exc:  # re-raised in the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="megagspo-rollouts-ahead", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the batch is generated; -> seconds waited (generation the step could not hide)."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error, self._prompts = self._error, None, None
            raise error
        return time.perf_counter() - t0

    def take(self) -> Rollouts:
        """The batch, which is then no longer held."""
        self.wait()
        rollouts = self._rollouts
        self._prompts = self._rollouts = None
        return rollouts

    # ---- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The held batch, complete (waits for it), in Rollouts' checkpoint form, and where the next batch's sampling
        continues (the generator); None if none is held."""
        if not self.holds_batch:
            return None
        self.wait()
        state = self._rollouts.state_dict()
        if self.generator is not None:
            state["tensors"]["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, tensors: dict, meta: dict) -> None:
        """Hold the checkpoint's batch as generated (the next step takes it)."""
        if meta.get("kind") == "producer":  # written by a producer process (filed here before it had its own key)
            print("the checkpoint's batches generated ahead come from rollout.producer = process: the thread starts "
                  "from the checkpoint's weights (the run continues; it is not a bit-for-bit replay)", flush=True)
            return
        self._rollouts = Rollouts.from_state(tensors, meta)
        self._prompts = self._rollouts.prompts
        self._thread, self._error = None, None
        if self.generator is not None and "generator" in tensors:
            self.generator.set_state(tensors["generator"])
