"""Dynamic sampling (DAPO, Yu et al. 2025, §3.2): a rollout group whose G rewards are all equal has zero
advantage under eq. 7, so it adds nothing to the policy gradient but its compute; with `rl.filter.enabled` such
groups are dropped and more prompts are drawn until the batch holds `rl.batch.prompts_per_step` informative groups.

Legend: B prompts of this data-parallel rank's share, G samples per prompt, R = B G responses, L response length,
P positions the engine fed (R3 routes).

The rounds (`RLStep.collect_scored`): each draws the next prompts_per_step prompts from the prompt stream (every
rank the same draw, each its own share), generates and scores them, and keeps the informative groups in the
order drawn until this rank's share is full. A new round runs while ANY data-parallel rank is short, so every
rank runs the same rounds (the stream and the engine's collectives stay in step), at most
`rl.filter.max_rounds` rounds in all. A rank still short after the last round fills its share with the
uninformative groups it dropped, in the order drawn (zero advantage: they change no gradient, they keep the
batch's shape and global counts), and says so in `filter/filled_frac`. Everything is a function of the seed:
the stream, the engine's sampling generator and the verifier are deterministic, so a resumed run draws the same
rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megagspo.rewards import RewardStats
from megagspo.rollout.base import RolloutOutput


def informative_groups(rewards_R: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [B]: the groups whose rewards are not all equal (nonzero advantages under eq. 7)."""
    rewards_BG = rewards_R.view(-1, group_size)
    return rewards_BG.amax(1) > rewards_BG.amin(1)


def select_groups(out: RolloutOutput, groups: list, group_size: int) -> RolloutOutput:
    """The rows of the listed groups, in that order."""
    return out.select_rows([g * group_size + i for g in groups for i in range(group_size)])


def concat_outputs(outputs: list, pad_id: int) -> RolloutOutput:
    """One RolloutOutput of several rounds' rows (RolloutOutput.concat: padded to the longest)."""
    return RolloutOutput.concat(outputs, pad_id)


def merge_stats(parts: list) -> RewardStats:
    """The verifier's counts over every scored round (the first error message seen)."""
    first = next((s.first_error for s in parts if s.first_error), "")
    return RewardStats(errors=sum(s.errors for s in parts), clamped=sum(s.clamped for s in parts),
                       timeouts=sum(s.timeouts for s in parts), first_error=first)


@dataclass
class GroupFilter:
    """One step's rounds on this rank: the kept informative groups and, in order, the dropped ones."""

    need: int                        # groups this rank's share holds (B)
    group_size: int
    kept: list = field(default_factory=list)       # (prompts of the group, output of the group, rewards [G])
    dropped: list = field(default_factory=list)
    rounds: int = 0
    generated: int = 0               # groups generated on this rank over the rounds
    informative: int = 0             # of which informative

    @property
    def short(self) -> int:
        return max(self.need - len(self.kept), 0)

    def add_round(self, prompts: list, out: RolloutOutput, rewards_R: torch.Tensor) -> None:
        g = self.group_size
        self.rounds += 1
        self.generated += len(prompts)
        flags = informative_groups(rewards_R, g).tolist()
        self.informative += sum(flags)
        for b, informative in enumerate(flags):
            group = ([prompts[b]], select_groups(out, [b], g), rewards_R[b * g:(b + 1) * g])
            (self.kept if informative and len(self.kept) < self.need else self.dropped).append(group)

    def result(self, pad_id: int):
        """-> (prompts [B], RolloutOutput [B G rows], rewards_R, filled groups): kept groups, then as many
        dropped ones as the share lacks."""
        filled = self.dropped[:self.short]
        groups = self.kept + filled
        prompts = [p for group in groups for p in group[0]]
        return (prompts, concat_outputs([group[1] for group in groups], pad_id),
                torch.cat([group[2] for group in groups]), len(filled))
