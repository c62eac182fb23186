"""The parts a checkpoint holds as state dicts, in one ordered table (torchtitan's pattern: the manager gets the
parts, not the trainer). The run registers each part once it is built; `CheckpointManager.save` writes them all
and `CheckpointManager.restore_parts` restores them in one pass, in table order, after the run is fully built.

A part is stored one of two ways, in the step folder's files (the format predates the table: old checkpoints
resume unchanged):
    Shared(key)          the part's state_dict() (JSON-able, the same on every rank: rank 0's is written) under
                         trainer_state.json[key]; on resume every rank's load_state_dict(state)
    PerRank(key, file)   each rank's own state in two halves, state_dict() -> {"tensors": {name: Tensor}, "meta":
                         JSON-able} or None (nothing to keep): tensors in <file> as rank<r>/<name>, metas in
                         trainer_state.json[key] as a list by rank. On resume load_state_dict(tensors, meta) when
                         the checkpoint holds this rank's state and was written by this process layout; otherwise
                         the part's start_afresh(step) when it has one, and the manager says so, with `note`
A part the checkpoint predates (no `key` in it) keeps the state it was built with.

Adding a part is one line where the run builds it (megagspo.trainer.trainer.Trainer._register_parts):
    parts.register("rng", run_rng, PerRank("rng", "rng.safetensors", note="..."))
A rollout source declares its own part (megagspo.rl.source_protocol.SourceCheckpoint): the one-step-ahead thread
"rollouts_ahead", the producer process "producer" (which ec55d2c filed under "rollouts_ahead": `legacy`).

Not in the table, on purpose: the weights and the optimizer's state (Megatron sharded checkpointing, collective)
are read as they are built, since the engine's first weight sync, the KL reference and the optimizer's fp32
master weights copy the policy then (CheckpointManager.load_model / load_optimizer, KLReference.resume); the
metrics rows are rewritten as the run's files open, before anything logs (CheckpointManager.prior_metrics).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Protocol, Union


class SharedState(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class PerRankState(Protocol):
    def state_dict(self) -> Optional[dict]: ...            # {"tensors": {...}, "meta": JSON-able} or None

    def load_state_dict(self, tensors: dict, meta: Any) -> None: ...


@dataclass(frozen=True)
class Shared:
    key: str                 # trainer_state.json[key]


@dataclass(frozen=True)
class PerRank:
    key: str                 # trainer_state.json[key]: the metas, by rank
    file: str                # the tensors, rank<r>/<name>
    note: str = ""           # what a resume on another process layout means for this part (said once)
    legacy: tuple = ()       # (key, file) pairs an earlier version stored the part under, read when `key` is absent


@dataclass(frozen=True)
class Part:
    name: str
    obj: Union[SharedState, PerRankState]
    storage: Union[Shared, PerRank]


class CheckpointParts:
    """The run's checkpointed parts, in registration order (the order of the restore pass)."""

    def __init__(self) -> None:
        self._parts: Dict[str, Part] = {}

    def register(self, name: str, obj, storage: Union[Shared, PerRank]) -> None:
        taken = {p.storage.key for p in self._parts.values()} | {p.storage.file for p in self.per_rank()}
        clash = {storage.key} | ({storage.file} if isinstance(storage, PerRank) else set())
        if name in self._parts or taken & clash:
            raise ValueError(f"checkpoint part {name!r}: its name or storage ({storage}) is another part's")
        self._parts[name] = Part(name, obj, storage)

    def __iter__(self) -> Iterator[Part]:
        return iter(self._parts.values())

    def __getitem__(self, name: str) -> Part:
        return self._parts[name]

    def names(self) -> List[str]:
        return list(self._parts)

    def shared(self) -> List[Part]:
        return [p for p in self if isinstance(p.storage, Shared)]

    def per_rank(self) -> List[Part]:
        return [p for p in self if isinstance(p.storage, PerRank)]


class DictState:
    """A dict (the run's summary so far) as a Shared part: its JSON copy saved, its saved items put back."""

    def __init__(self, target: dict) -> None:
        self.target = target

    def state_dict(self) -> dict:
        return json.loads(json.dumps(self.target))

    def load_state_dict(self, state: dict) -> None:
        self.target.update(state)


__all__ = ["CheckpointParts", "DictState", "Part", "PerRank", "PerRankState", "Shared", "SharedState"]
