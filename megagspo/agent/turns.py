"""The engine as one sample's agent sees it: `engine.generate(ids, sampling) -> TurnOutput`, token in, token out.

Each sample's agent runs on a thread of its own (megagspo.agent.runner); its turns are batched with its peers'
by `TurnBatcher`: a request waits until every sample still running has either asked for its next turn or finished,
then all waiting turns go to the rollout engine in one generate call, ordered by sample, one row each. The batch a
turn joins is a function of the samples' own histories, never of thread timing, so with a seeded engine the
trajectories are a function of the seed (resume is exact). A turn asks for at most `sampling.max_new_tokens`; the
call runs to the largest budget of the batch and each turn keeps its own budget's tokens.

Legend (docs/architecture.md): P positions fed, Ly MoE layers, K top-k.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Dict, List, Optional

from megagspo.rollout.base import RolloutOutput, SamplingParams, WeightSwitch

from .trajectory import TurnOutput

Generate = Callable[..., RolloutOutput]   # an engine's generate(prompt ids, n, sampling, switch=)


def _turn_of(out: RolloutOutput, row: int, prompt_len: int, budget: int, eos_ids: tuple) -> TurnOutput:
    """Row `row` of a batch's output, cut to the turn's own budget."""
    n = min(int(out.response_mask_RL[row].sum()), budget)
    ids = out.response_ids_RL[row, :n].tolist()
    routes = None
    if out.routes_RPLyK is not None:
        routes = out.routes_RPLyK[row, :prompt_len + n - 1].clone()
    versions = None if out.version_RL is None else out.version_RL[row, :n].tolist()
    return TurnOutput(ids, out.logp_RL[row, :n].tolist(), routes, versions, bool(ids) and ids[-1] in eos_ids)


@dataclasses.dataclass
class _Request:
    ids: List[int]
    sampling: SamplingParams
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Optional[TurnOutput] = None
    error: Optional[BaseException] = None


class TurnBatcher:
    """Batches the turns of `live` samples' threads (see the module docstring). `switch`: partial rollouts, passed
    to every engine call (weights may change between and within turns; each token keeps its version)."""

    def __init__(self, generate: Generate, live: int, eos_ids: tuple, switch: Optional[WeightSwitch] = None) -> None:
        self._generate, self.switch, self.eos_ids = generate, switch, tuple(eos_ids)
        self._live = live
        self._waiting: Dict[int, _Request] = {}
        self._lock = threading.Lock()
        self.calls = 0     # engine generate calls made (a turn of every live sample per call, when they align)

    def generate(self, sample: int, ids: List[int], sampling: SamplingParams) -> TurnOutput:
        if sampling.max_new_tokens < 1:
            raise ValueError(f"sample {sample}: a turn needs max_new_tokens >= 1, got {sampling.max_new_tokens}")
        request = _Request(list(ids), sampling)
        with self._lock:
            self._waiting[sample] = request
            batch = self._take_if_full()
        if batch:
            self._run(batch)
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.result

    def finished(self) -> None:
        """A sample's thread ended (its trajectory is done, or its hook failed)."""
        with self._lock:
            self._live -= 1
            batch = self._take_if_full()
        if batch:
            self._run(batch)

    def _take_if_full(self) -> Optional[Dict[int, _Request]]:
        if self._waiting and len(self._waiting) >= self._live:
            batch, self._waiting = self._waiting, {}
            return batch
        return None

    def _run(self, batch: Dict[int, _Request]) -> None:
        """One engine call per sampling setting (temperature, top-p, greedy) among the waiting turns, in sample
        order; every waiting thread is released, with its turn or the engine's error."""
        try:
            groups: Dict[tuple, list] = {}
            for sample in sorted(batch):
                s = batch[sample].sampling
                groups.setdefault((s.temperature, s.top_p, s.greedy, id(s.generator)), []).append(sample)
            for samples in groups.values():
                requests = [batch[s] for s in samples]
                budget = max(r.sampling.max_new_tokens for r in requests)
                sampling = dataclasses.replace(requests[0].sampling, max_new_tokens=budget)
                out = self._generate([r.ids for r in requests], 1, sampling, switch=self.switch)
                self.calls += 1
                for row, r in enumerate(requests):
                    r.result = _turn_of(out, row, len(r.ids), r.sampling.max_new_tokens, self.eos_ids)
        except BaseException as exc:  # noqa: BLE001 - every waiting sample fails with the engine's error
            for r in batch.values():
                r.error = r.error or exc
        finally:
            for r in batch.values():
                r.done.set()


class SampleEngine:
    """The engine handle one sample's agent gets: generate(ids, sampling) -> TurnOutput."""

    def __init__(self, batcher: TurnBatcher, sample: int) -> None:
        self._batcher, self.sample = batcher, sample

    def generate(self, ids: List[int], sampling: SamplingParams) -> TurnOutput:
        """The next assistant turn after `ids` (the whole trajectory so far: prompt, turns, tool text, and the
        generation prompt), at most sampling.max_new_tokens ids."""
        return self._batcher.generate(self.sample, ids, sampling)


__all__ = ["SampleEngine", "TurnBatcher", "TurnOutput"]
