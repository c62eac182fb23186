"""One multi-turn trajectory as the trainer sees it, built turn by turn, and the RolloutOutput a batch of them makes.

A trajectory is one sequence: the first prompt, then every sampled assistant turn and, between turns, the tool /
user text and the template's boundary tokens, all as ids (token in, token out: sampled ids are appended as they
are). Only sampled tokens carry loss mask 1, a rollout log-prob and a weight version; every other token is context
(mask 0, log-prob and version 0, never read).

Routes (R3) are kept per position the engine fed: a turn's generation feeds the whole prefix, and only the rows
past what earlier turns covered are appended (an earlier turn's rows are never overwritten by a later prefill). The
last token a turn sampled is first fed by the next turn's prefill, so its route comes from there; the very last
token of a trajectory is never a model input in training, so it needs none. No row is ever a filler.

Legend (docs/architecture.md): P positions fed (prompt + ids[:-1]), Ly MoE layers, K top-k, R rows, L the longest
trajectory after its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from megagspo.rollout.base import RolloutOutput

# done: the model gave its answer (a turn without tool calls) | truncated: the length budget cut it (the reward is
# 0 and the metrics count it) | max_turns: the turn limit came while the model still called tools
STATUSES = ("done", "truncated", "max_turns")


@dataclass
class TurnOutput:
    """One sampled turn: the new ids, their log-probs, the routes of every position the engine fed for them (the
    prefix and ids[:-1], [P, Ly, K] int16, or None), the weight version of each id (partial rollouts; None when the
    engine held one version), and whether it ended with a stop token."""

    ids: List[int]
    logp: List[float]
    routes_PLyK: Optional[torch.Tensor]
    versions: Optional[List[int]]
    ended: bool


@dataclass
class Trajectory:
    """What an agent hook returns: `run(sample, engine, sampling) -> Trajectory`."""

    prompt_ids: List[int]
    ids: List[int] = field(default_factory=list)            # everything after the prompt
    sampled: List[bool] = field(default_factory=list)       # loss mask: True exactly where the engine sampled
    logp: List[float] = field(default_factory=list)         # the engine's log-prob of sampled tokens, 0 elsewhere
    versions: Optional[List[int]] = None                    # per id: the sampling version, 0 elsewhere (partial)
    routes_PLyK: Optional[torch.Tensor] = None              # rows of prompt + ids[:-1] covered so far
    reward: Optional[float] = None                          # an environment's own reward (else the verifier's)
    status: str = "done"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Dict[str, int] = field(default_factory=dict)
    tool_truncations: int = 0                               # tool responses cut to max_tool_response_tokens
    prefix_rewrites: int = 0                                # turns the template re-rendered history (policy keep)
    final_text: str = ""                                    # what the verifier reads

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add_sampled(self, turn: TurnOutput) -> None:
        """A turn's sampled ids (mask 1), its log-probs and versions, and the routes of the positions it fed that
        no earlier turn covered."""
        if turn.routes_PLyK is not None:
            covered = 0 if self.routes_PLyK is None else self.routes_PLyK.shape[0]
            fed = self.length + len(turn.ids) - 1  # this turn's prefix and its ids but the last
            if turn.routes_PLyK.shape[0] < fed:
                raise RuntimeError(f"the engine returned routes for {turn.routes_PLyK.shape[0]} positions of a turn "
                                   f"that fed {fed}")
            new = turn.routes_PLyK[covered:fed]
            self.routes_PLyK = new.clone() if self.routes_PLyK is None else torch.cat([self.routes_PLyK, new])
        if turn.versions is not None and self.versions is None:
            self.versions = [0] * len(self.ids)
        self.ids.extend(turn.ids)
        self.sampled.extend([True] * len(turn.ids))
        self.logp.extend(float(x) for x in turn.logp)
        if self.versions is not None:
            self.versions.extend(turn.versions if turn.versions is not None else [0] * len(turn.ids))
        self.turns += 1

    def add_context(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not sample (tool / user text, template boundary tokens): loss mask 0."""
        self.ids.extend(int(i) for i in ids)
        self.sampled.extend([False] * len(ids))
        self.logp.extend([0.0] * len(ids))
        if self.versions is not None:
            self.versions.extend([0] * len(ids))

    def count_error(self, kind: str) -> None:
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    def row(self) -> dict:
        """The JSON-able summary RolloutOutput.agent_rows keeps (checkpoints, the producer's pipe, metrics)."""
        return {"status": self.status, "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": dict(self.tool_errors), "tool_truncations": self.tool_truncations,
                "prefix_rewrites": self.prefix_rewrites,
                "final_text": self.final_text, "reward": self.reward}

    def check(self, where: str) -> None:
        """The invariants a hook's trajectory must hold (a user hook may build one by hand)."""
        n = len(self.ids)
        if not (len(self.sampled) == len(self.logp) == n) or (self.versions is not None and len(self.versions) != n):
            raise ValueError(f"{where}: ids, loss mask, log-probs and versions differ in length")
        if self.status not in STATUSES:
            raise ValueError(f"{where}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        if n == 0 or not self.sampled[-1]:
            raise ValueError(f"{where}: a trajectory must end with a sampled token (it has {n} ids)")
        fed = self.length - 1
        if self.routes_PLyK is not None and self.routes_PLyK.shape[0] != fed:
            raise ValueError(f"{where}: routes cover {self.routes_PLyK.shape[0]} positions, the trajectory feeds {fed}")


def stack_trajectories(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutOutput:
    """A batch of trajectories as one RolloutOutput (rows in order): everything after the prompt is the response
    (response_mask_RL), the sampled tokens its loss mask (loss_mask_RL)."""
    rows = len(trajectories)
    length = max(len(t.ids) for t in trajectories)
    response_RL = torch.full((rows, length), pad_id, dtype=torch.long)
    mask_RL = torch.zeros((rows, length), dtype=torch.bool)
    sampled_RL = torch.zeros((rows, length), dtype=torch.bool)
    logp_RL = torch.zeros((rows, length), dtype=torch.float32)
    with_versions = any(t.versions is not None for t in trajectories)
    version_RL = torch.zeros((rows, length), dtype=torch.long) if with_versions else None
    routes = None
    with_routes = [t.routes_PLyK for t in trajectories if t.routes_PLyK is not None]
    if with_routes:
        if len(with_routes) != rows:
            raise ValueError("some trajectories carry routes and others do not")
        positions = max(t.length - 1 for t in trajectories)
        routes = torch.full((rows, positions, *with_routes[0].shape[1:]), -1, dtype=torch.int16)
    for r, t in enumerate(trajectories):
        n = len(t.ids)
        response_RL[r, :n] = torch.tensor(t.ids, dtype=torch.long)
        mask_RL[r, :n] = True
        sampled_RL[r, :n] = torch.tensor(t.sampled, dtype=torch.bool)
        logp_RL[r, :n] = torch.tensor(t.logp, dtype=torch.float32)
        if version_RL is not None and t.versions is not None:
            version_RL[r, :n] = torch.tensor(t.versions, dtype=torch.long)
        if routes is not None:
            routes[r, :t.routes_PLyK.shape[0]] = t.routes_PLyK.to(torch.int16)
    return RolloutOutput([list(t.prompt_ids) for t in trajectories], response_RL, mask_RL, logp_RL, routes,
                         version_RL, loss_mask_RL=sampled_RL, agent_rows=[t.row() for t in trajectories])
