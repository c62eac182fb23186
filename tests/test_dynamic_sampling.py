"""Dynamic sampling (rl.filter_groups; megagspo.rl.dynamic_sampling): the group filter's rounds on synthetic
rollouts (which groups are kept, in what order, the zero-advantage fill, the padding of rounds of different
lengths), and a real `megagspo train` run that filters (several rounds on some step), killed and resumed: every
metric equals the uninterrupted run's."""

from __future__ import annotations

import signal

import pytest
import torch

from megagspo.rl.dynamic_sampling import GroupFilter, concat_outputs, informative_groups, merge_stats
from megagspo.rollout.base import RolloutOutput

G = 2  # samples per prompt


def _round(tag: int, rewards: list, length: int, positions: int):
    """A round of len(rewards) // G groups: response ids tag*100 + row, `length` tokens, routes over `positions`."""
    rows = len(rewards)
    out = RolloutOutput(
        prompt_ids=[[tag, r] for r in range(rows)],
        response_ids_RL=torch.arange(rows).unsqueeze(1).expand(rows, length) + tag * 100,
        response_mask_RL=torch.ones(rows, length, dtype=torch.bool),
        logp_RL=-torch.rand(rows, length),
        routes_RPLyK=torch.zeros(rows, positions, 1, 2, dtype=torch.long) + tag)
    prompts = [f"p{tag}.{b}" for b in range(rows // G)]
    return prompts, out, torch.tensor(rewards, dtype=torch.float32)


def test_informative_groups_are_those_with_unequal_rewards():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5]), 2).tolist() == \
        [False, True, False, False]


def test_rounds_keep_informative_groups_in_order_and_pad_to_the_longest():
    f = GroupFilter(need=3, group_size=G)
    f.add_round(*_round(1, [1, 1, 0, 1, 0, 0], length=3, positions=4))   # keeps group 1 only
    assert (f.short, f.rounds, f.generated, f.informative) == (2, 1, 3, 1)
    f.add_round(*_round(2, [0, 1, 1, 1, 1, 0, 0, 1], length=5, positions=6))  # groups 0, 2 (3 is one too many)
    assert f.short == 0 and f.informative == 4
    prompts, out, rewards_R, filled = f.result(pad_id=-7)
    assert prompts == ["p1.1", "p2.0", "p2.2"] and filled == 0
    assert rewards_R.tolist() == [0, 1, 0, 1, 1, 0]
    assert out.response_ids_RL.shape == (6, 5) and out.routes_RPLyK.shape == (6, 6, 1, 2)
    assert out.response_ids_RL[:2, :3].tolist() == [[102, 102, 102], [103, 103, 103]]
    assert (out.response_ids_RL[:2, 3:] == -7).all() and not out.response_mask_RL[:2, 3:].any()
    assert (out.logp_RL[:2, 3:] == 0).all() and (out.routes_RPLyK[:2, 4:] == -1).all()
    assert out.response_ids_RL[2:, 0].tolist() == [200, 201, 204, 205]
    assert out.prompt_ids[2:4] == [[2, 0], [2, 1]]


def test_a_share_still_short_is_filled_with_dropped_groups_in_order():
    f = GroupFilter(need=2, group_size=G)
    f.add_round(*_round(1, [1, 1, 0, 1], length=2, positions=2))
    f.add_round(*_round(2, [0, 0, 1, 1], length=2, positions=2))
    prompts, _, rewards_R, filled = f.result(pad_id=0)
    assert prompts == ["p1.1", "p1.0"] and filled == 1 and rewards_R.tolist() == [0, 1, 1, 1]


def test_reward_stats_of_the_rounds_add_up():
    from megagspo.rewards import RewardStats

    merged = merge_stats([RewardStats(errors=1, timeouts=1), RewardStats(errors=2, clamped=3, first_error="x")])
    assert (merged.errors, merged.clamped, merged.timeouts, merged.first_error) == (3, 3, 1, "x")
    assert concat_outputs([_round(1, [0, 1], 2, 2)[1]], 0).response_ids_RL.shape == (2, 2)


# exact_match after a short SFT: many groups score all 0 (dropped), so steps need more than one round
FILTER_ARGS = ["reward.name=exact_match", "rl.filter_groups=true", "rl.filter_max_rounds=3", "rl.steps=4",
               "rl.eval_every=4", "rl.eval_samples=0", "checkpoint.every_steps=1"]


@pytest.mark.slow
def test_filtered_run_killed_and_resumed_equals_uninterrupted(tmp_path):
    from helpers import CliRuns
    from test_checkpoint_resume import _assert_same_metrics, _cmd, _env, _rows, _served, _start_and_wait

    cli = CliRuns(_env(), str(tmp_path / "cli.log"))  # the runs only read afterwards; the killed one has its own
    try:
        _served(cli, _cmd(tmp_path, "ref", *FILTER_ARGS))
        rl = [r for r in _rows(tmp_path / "ref") if r["phase"] == "rl"]
        assert len(rl) == 4 and all(r["filter/rounds"] >= 1 for r in rl)
        assert any(r["filter/rounds"] > 1 for r in rl), [r["filter/rounds"] for r in rl]  # the filter did act
        assert all(0 <= r["filter/informative_frac"] <= 1 and 0 <= r["filter/filled_frac"] <= 1 for r in rl)
        proc = _start_and_wait(_cmd(tmp_path, "k", *FILTER_ARGS), tmp_path / "k", min_rl_rows=2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        _served(cli, _cmd(tmp_path, "k", *FILTER_ARGS, "--resume"))
        _assert_same_metrics(tmp_path / "ref", tmp_path / "k")
    finally:
        cli.close()
