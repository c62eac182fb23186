"""The trainer's handle on the rollout producer process (megagspo.rl.producer): start it under the pipes of
megagspo.rl.producer_pipes, send it weights by version, take its batches in order, restart it when it died, or stop
the run after MAX_RESTARTS deaths in a row with one line (ProducerFailed). The fault model: docs/robustness.md."""

from __future__ import annotations

import pickle
import signal
from typing import Callable, Optional

from megagspo.data.datasets import PromptDataset
from megagspo.rl.producer import ProducedBatch, ProducerSpec, producer_main
from megagspo.rl.producer_pipes import Frames, Sender, stops_blocked


class ProducerFailed(RuntimeError):
    """The producer died MAX_RESTARTS + 1 times in a row without handing over a batch; the message names the batch
    and the last exit code (the CLI prints it as one line)."""


def exit_text(code: Optional[int]) -> str:
    """A process's exit code as a user reads it: `exit code -9 (SIGKILL)`."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class ProducerProcess:
    """The trainer's handle on the producer: start it, send weights by version, take batches in order, restart it
    when it died. Keeps every version a batch not yet received may still need (to replay after a restart)."""

    POLL_S = 0.5  # how often a wait for a batch looks at the producer besides its pipe and sentinel
    MAX_RESTARTS = 3  # in a row without a batch received: a producer that fails by itself (its traceback is on
    #                   stderr), not one that was killed, is an error rather than a loop

    def __init__(self, spec: ProducerSpec, dataset: PromptDataset, say: Callable[[str], None] = print) -> None:
        import torch.multiprocessing as tmp

        self.spec, self.dataset, self.say = spec, dataset, say
        self.ctx = tmp.get_context("spawn")
        self.bound = max(spec.staleness, 1)  # batches sent and not taken
        self.proc = None
        self.frames: Optional[Frames] = None
        self.sender: Optional[Sender] = None
        self.slots = None
        self.sent: dict = {}         # version -> [bucket dicts] (shared memory), the versions still needed
        self.start_state: dict = {}  # where a (re)started producer continues: the state after the last batch taken
        self.restarts = 0
        self._in_a_row = 0

    # ---- lifetime ----------------------------------------------------------------------------------
    def start(self, state: dict) -> None:
        """(Re)start the producer from `state` ({"next", "floor", "dataset", "generator"}) and replay the kept
        versions it needs."""
        import multiprocessing

        if multiprocessing.current_process().daemon:
            raise RuntimeError("rollout.producer = process: this process is a daemonic multiprocessing child, which "
                               "may not start the producer process; run the trainer from a normal process (the CLI, "
                               "torchrun) or use rollout.producer = thread")
        self.start_state = dict(state)
        commands_r, commands_w = self.ctx.Pipe(duplex=False)
        results_r, results_w = self.ctx.Pipe(duplex=False)
        self.slots = self.ctx.Semaphore(self.bound)
        self.proc = self.ctx.Process(target=producer_main, name="megagspo-rollout-producer",
                                     args=(commands_r, results_w, self.slots))
        with stops_blocked():
            self.proc.start()
        commands_r.close()  # each end in one process: the producer's death ends both pipes
        results_w.close()
        self.frames, self.sender = Frames(results_r), Sender(commands_w)
        self.sender.put((self.spec, self.dataset, self.start_state))
        for version in sorted(self.sent):
            self.sender.put((version, self.sent[version]))

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)  # reaps it
        self.sender.close()
        self.frames.close()
        if self.proc.exitcode is not None:
            self.proc.close()
        self.proc = None

    # ---- weights ------------------------------------------------------------------------------------
    def send_weights(self, version: int, buckets: list) -> None:
        self.sent[version] = buckets
        self.sender.put((version, buckets))

    def _forget_before(self, version: int) -> None:
        for v in [v for v in self.sent if v < version]:
            del self.sent[v]

    # ---- batches ------------------------------------------------------------------------------------
    def depth(self) -> int:
        """Batches sent (or being sent) and not taken."""
        try:
            return self.bound - self.slots.get_value()
        except NotImplementedError:  # macOS
            return -1

    def take(self, index: int) -> ProducedBatch:
        """Batch `index` (the next one in order); restarts the producer from the last batch taken if it died, a
        batch half received included."""
        while True:
            payload = self.frames.receive(self.POLL_S, self.proc.sentinel)
            if payload is None:
                if self.proc.is_alive():
                    if self.frames.ended:  # it closed its end: it is ending
                        self.proc.join(self.POLL_S)
                    continue
                payload = self.frames.receive(0)  # a frame it wrote whole before it ended is still in the pipe
                if payload is None:
                    self._restart()
                    continue
            self.slots.release()
            batch = pickle.loads(payload)
            if batch.index != index:
                raise RuntimeError(f"rollout producer: got batch {batch.index}, expected {index}")
            self.start_state = dict(batch.post)
            self._in_a_row = 0
            self._forget_before(self.spec.version_for(batch.index + 1, batch.post["floor"]))
            return batch

    def _restart(self) -> None:
        code = self.proc.exitcode
        self.close()
        if self._in_a_row >= self.MAX_RESTARTS:
            raise ProducerFailed(f"rollout producer: died {self._in_a_row + 1} times in a row at batch "
                                 f"{self.start_state['next']} (last {exit_text(code)}"
                                 + ("; its traceback is on stderr)" if code and code > 0 else ")"))
        self.restarts += 1
        self._in_a_row += 1
        self.say(f"rollout producer died ({exit_text(code)}); restarted at batch {self.start_state['next']} from "
                 "the state after the last batch received (nothing lost or repeated)")
        self.start(self.start_state)
