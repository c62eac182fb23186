"""What a rollout source is to the step and the trainer (megagspo.rl.sources has the sources): a batch per step,
its engines brought up to date after each update, a close, and its checkpoint state under a key of its own kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from megagspo.policy.engine_link import EngineLink
from megagspo.rl.batch_maker import Rollouts, Scores


@dataclass
class SourcedBatch:
    rollouts: Rollouts
    scores: Scores
    metrics: dict = field(default_factory=dict)   # the source's own (filter/*, rollout/staleness_*)
    times: dict = field(default_factory=dict)     # time/rollout_s, time/reward_s, ...


class SourceState(Protocol):
    """A source's per-rank checkpoint state (megagspo.checkpoint.parts.PerRank)."""

    def state_dict(self) -> Optional[dict]: ...            # {"tensors": {...}, "meta": JSON-able} or None

    def load_state_dict(self, tensors: dict, meta: dict) -> None: ...


@dataclass(frozen=True)
class SourceCheckpoint:
    """Where a kind of source keeps its state in a checkpoint: its own key of trainer_state.json and its own
    tensors file; `legacy`: (key, file) pairs that earlier versions filed it under, read when `key` is absent."""

    key: str
    file: str
    state: SourceState
    note: str                         # what a resume on another process layout means for it (said once)
    legacy: tuple = ()


class RolloutSource(Protocol):
    checkpoint: Optional[SourceCheckpoint]

    def next(self, step: int) -> SourcedBatch:
        """This rank's scored rollouts for update `step`."""

    def after_update(self, link: EngineLink) -> dict:
        """After the step's update: bring the source's engines up to date; -> its times."""

    def close(self) -> None:
        """End the source's threads or processes."""
