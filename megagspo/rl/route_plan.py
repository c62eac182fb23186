"""Which routes each forward of an RL step uses, chosen once from rl.routing_replay and rl.old_policy.source:

    record          (none)  every forward routes with its own router and records what it chose; pi_old's routes are
                            the recompute's (or the engine's, when pi_old is the engine's: old_policy.source = rollout)
    replay_old      (r2)    the recompute records pi_old's routes; the update's forwards replay them
    replay_engine   (r3)    the recompute and the update's forwards replay the engine's routes

Expert volatility compares a forward of the updated policy with pi_old's routes: without replay, the update's own
forward is that forward; under replay it is one more free forward that records.

Legend (docs/architecture.md): T' the positions of a micro-batch's model input, Ly MoE layers of this pipeline
stage, K top-k.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from megagspo.config_training import RLConfig
from megagspo.policy.megatron_policy import MegatronPolicy

RECORD, REPLAY_OLD, REPLAY_ENGINE = "record", "replay_old", "replay_engine"
_KINDS = {"none": RECORD, "r2": REPLAY_OLD, "r3": REPLAY_ENGINE}


class RoutePlan:
    """The step's routes (see the module docstring): contexts for each pass over micro-batches, and where the
    routes each pass recorded are kept."""

    def __init__(self, policy: MegatronPolicy, rl: RLConfig) -> None:
        self.policy = policy
        self.kind = _KINDS[rl.routing_replay]
        self.reads_engine_routes = rl.reads_engine_routes   # the step packs the engine's routes exactly then

    @property
    def replays(self) -> bool:
        return self.kind != RECORD

    def engine_routes(self, micro: list) -> List[Optional[torch.Tensor]]:
        """The engine's routes of each micro-batch in its model input's storage order ([T', Ly, K]), None without."""
        return [mb.seqs.routes_for(mb.view, self.policy.device) for mb in micro]

    def for_recompute(self, micro: list):
        """-> (context(i) for the pi_old recompute of micro-batch i, pi_old's routes: filled by that pass)."""
        if self.kind == REPLAY_ENGINE:
            routes = self.engine_routes(micro)
            return (lambda i: self.policy.replaying(routes[i])), routes
        routes: List[Optional[torch.Tensor]] = [None] * len(micro)
        return self.recording_into(routes), routes

    def for_update(self, old_routes: list, new_routes: list) -> Callable:
        """context(j) for the update's forward of micro-batch j: replaying its pi_old routes, or recording into
        new_routes[j]."""
        if self.replays:
            return lambda j: self.policy.replaying(old_routes[j])
        return self.recording_into(new_routes)

    def recording_into(self, store: list) -> Callable:
        """context(i) recording this stage's routes of one forward into store[i] ([T', Ly, K])."""
        policy = self.policy

        @contextlib.contextmanager
        def record(i):
            with policy.recording() as rec:
                yield
            store[i] = rec.routes

        return record
