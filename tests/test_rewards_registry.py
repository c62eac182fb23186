"""Rewards: registry with named errors; a failing / NaN verifier scores 0 and is counted."""

import math

import pytest

from megagspo.rewards import RewardStats, available_rewards, get_reward, register_reward, score_batch


def test_exact_match_and_last_number():
    em = get_reward("exact_match")
    assert em(" 42 ", "42") == 1.0 and em("421", "42") == 0.0
    ln = get_reward("last_number")
    assert ln("so the answer is 1,234", "1234") == 1.0 and ln("no number", "3") == 0.0


def test_unknown_reward_lists_names():
    with pytest.raises(ValueError, match="unknown reward 'nope'; valid names: .*exact_match"):
        get_reward("nope")


def test_errors_and_nan_score_zero_and_are_counted():
    @register_reward("_test_flaky")
    def flaky(response, answer):
        if response == "boom":
            raise RuntimeError("verifier crashed")
        if response == "nan":
            return math.nan
        return 7.0 if response == "big" else 1.0

    stats = RewardStats()
    scores = score_batch(get_reward("_test_flaky"), ["ok", "boom", "nan", "big"], ["a"] * 4, stats)
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert stats.errors == 2 and stats.clamped == 1 and "verifier crashed" in stats.first_error
    assert "_test_flaky" in available_rewards()


def test_digit_match_partial_credit_below_exact():
    dm = get_reward("digit_match")
    assert dm("123", "123") == 1.0
    assert dm("124", "123") == pytest.approx(0.5 * 2 / 3)
    assert dm("", "12") == 0.0 and dm("99999", "12") < 0.5
