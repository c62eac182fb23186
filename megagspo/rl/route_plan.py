"""Which routes each forward of an RL step uses, chosen once from rl.routing_replay and rl.old_policy.source:

    record          (none)  every forward routes with its own router and records what it chose; pi_old's routes are
                            the recompute's (or the engine's, when pi_old is the engine's: old_policy.source = rollout)
    replay_old      (r2)    the recompute records pi_old's routes; the update's forwards replay them
    replay_engine   (r3)    the recompute and the update's forwards replay the engine's routes

With rl.route_gap the plan also keeps the trainer's own choices where it replays (the live router's top-k beside
the replayed one in the update; a free forward at pi_old under R3), for the route-gap metrics (RouteGap). Expert volatility compares a free forward of the policy
after each update with pi_old's routes, in every arm alike.

Legend (docs/architecture.md): T' the positions of a micro-batch's model input, T its sequences' tokens, Ly MoE
layers of this pipeline stage, K top-k.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from megagspo.config_training import RLConfig
from megagspo.policy.megatron_policy import MegatronPolicy
from moe.routing_replay import RecordedRoutes

RECORD, REPLAY_OLD, REPLAY_ENGINE = "record", "replay_old", "replay_engine"
_KINDS = {"none": RECORD, "r2": REPLAY_OLD, "r3": REPLAY_ENGINE}


class RoutePlan:
    """The step's routes (see the module docstring): contexts for each pass over micro-batches, and where the
    routes each pass recorded are kept."""

    def __init__(self, policy: MegatronPolicy, rl: RLConfig) -> None:
        self.policy = policy
        self.kind = _KINDS[rl.routing_replay]
        self.reads_engine_routes = rl.reads_engine_routes   # the step packs the engine's routes exactly then
        self.measures_gap = bool(rl.route_gap)

    @property
    def replays(self) -> bool:
        return self.kind != RECORD

    def engine_routes(self, micro: list) -> List[Optional[torch.Tensor]]:
        """The engine's routes of each micro-batch in its model input's storage order ([T', Ly, K]), None without."""
        return [mb.seqs.routes_for(mb.view, self.policy.device) for mb in micro]

    def for_recompute(self, engine_routes: list):
        """-> (context(i) for the pi_old recompute of micro-batch i, pi_old's routes, the trainer's own routes at
        pi_old or None), given the engine's routes of each micro-batch (`engine_routes`): the lists are filled by
        that pass. Recording, both are what the routers chose; replaying the engine's, pi_old's routes are the
        engine's and the trainer's own need a free forward of their own (`own_routes`): under replay a router's live
        choice sees the hidden states the replayed layers before it made, not the trainer's."""
        if self.kind == REPLAY_ENGINE:
            return self.replaying(engine_routes, None), engine_routes, None
        routes = [None] * len(engine_routes)
        return self.recording_into(routes), routes, routes

    def own_routes(self, inputs: list) -> list:
        """The routers' own choices of a free no-grad forward of each micro-batch ([T', Ly, K] each)."""
        routes = [None] * len(inputs)
        self.policy.run_micro_batches(inputs, context=self.recording_into(routes))
        return routes

    def for_update(self, old_routes: list, live_routes: list) -> Callable:
        """context(j) for the update's forward of micro-batch j: replaying its pi_old routes (with rl.route_gap the
        live routers' choices into live_routes[j]), or routing freely."""
        if self.replays:
            return self.replaying(old_routes, live_routes if self.measures_gap else None)
        return lambda j: contextlib.nullcontext()

    def replaying(self, routes: list, live: Optional[list]) -> Callable:
        """context(i) replaying routes[i]; with `live`, the routers' own top-k of that forward into live[i]."""
        policy = self.policy

        @contextlib.contextmanager
        def replay(i):
            rec = RecordedRoutes() if live is not None else None
            with policy.replaying(routes[i], live=rec):
                yield
            if live is not None:
                live[i] = rec.routes

        return replay

    def recording_into(self, store: list) -> Callable:
        """context(i) recording this stage's routes of one forward into store[i] ([T', Ly, K])."""
        policy = self.policy

        @contextlib.contextmanager
        def record(i):
            with policy.recording() as rec:
                yield
            store[i] = rec.routes

        return record


class RouteGap:
    """Counts of top-k sets that differ between two route tensors of the same tokens, on loss-mask tokens only:
    (token, layer) pairs of this stage, and tokens with at least one differing layer (OR-ed over the stages by the
    caller). The sets are compared, not the order of their ids."""

    def __init__(self) -> None:
        self.pairs_differ = self.pairs = 0.0
        self.token_masks: list = []     # per micro-batch: [T] bool, some layer of this stage differs (loss tokens)

    def add(self, a_TLK: torch.Tensor, b_TLK: torch.Tensor, loss_mask_T: torch.Tensor) -> None:
        mask_T = loss_mask_T.bool().to(a_TLK.device)
        differ_TL = (a_TLK.long().sort(-1).values != b_TLK.long().to(a_TLK.device).sort(-1).values).any(-1)
        differ_TL = differ_TL & mask_T[:, None]
        self.pairs_differ += float(differ_TL.sum())
        self.pairs += float(mask_T.sum()) * differ_TL.shape[1]
        self.token_masks.append(differ_TL.any(-1))

    @classmethod
    def of(cls, dims, micro: list, a: list, b: list, prefix: str) -> dict:
        """The metrics of routes a[i] against b[i] (storage order) at each micro-batch's loss tokens, with the
        token share; {} where either is missing (collective otherwise)."""
        if not micro or a[0] is None or b[0] is None:
            return {}
        gap = cls()
        for i, mb in enumerate(micro):
            gap.add(mb.tokens_of(a[i]), mb.tokens_of(b[i]), mb.seqs.loss_mask_T)
        return gap.metrics(dims, prefix, [float(mb.seqs.loss_mask_T.sum()) for mb in micro])

    def metrics(self, dims, prefix: str, token_counts: Optional[List[float]] = None) -> dict:
        """{prefix}pair_frac and, where `token_counts` (loss tokens per micro-batch) are given, {prefix}token_frac;
        summed over the data-parallel ranks and the pipeline stages (collective)."""
        # OR over the stages (a collective per micro-batch): only where the token share is asked for
        tokens_differ = sum(float(dims.pp_any(m).sum()) for m in self.token_masks) if token_counts is not None else 0.0
        pairs_differ, pairs = dims.pp_sum([self.pairs_differ, self.pairs])
        sums = dims.dp_sum([pairs_differ, pairs, tokens_differ, float(sum(token_counts or []))])
        out = {f"{prefix}pair_frac": sums[0] / max(sums[1], 1.0)}
        if token_counts is not None:
            out[f"{prefix}token_frac"] = sums[2] / max(sums[3], 1.0)
        return out
