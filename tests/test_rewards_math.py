"""The `math` reward (math-verify): the answer forms math datasets use, GSM8K's "####" on both sides, wrong
answers, and a verifier failure that scores 0 and is counted instead of stopping the run."""

import pytest

from megagspo.rewards import RewardStats, get_reward, score_batch
from megagspo.rewards.math_answers import final_answer

MATH = get_reward("math")

# (response, reference answer, reward)
CASES = [
    ("The answer is \\boxed{72}.", "72", 1.0),
    ("so 70 + 2 = 72", "72", 1.0),                                       # plain number, no box
    ("We get \\boxed{\\frac{1}{2}}", "0.5", 1.0),                         # fraction vs decimal
    ("$0.5$", "\\frac{1}{2}", 1.0),                                       # LaTeX reference
    ("\\boxed{1000}", "1,000", 1.0),                                      # thousands separator
    ("\\boxed{x^2 + 2x}", "2x + x^2", 1.0),                               # equal expressions
    ("48 / 2 = 24 clips.\n#### 72", "Natalia sold 48/2 = 24 clips ... #### 72", 1.0),  # GSM8K both sides
    ("24 and then 71", "72", 0.0),
    ("#### 71", "... #### 72", 0.0),                                      # the marked answer counts, not 72 elsewhere
    ("", "3", 0.0),
    ("\\boxed{3}", "\\boxed{3}", 1.0),
]


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_math_reward(response, answer, expected):
    assert MATH(response, answer) == expected


def test_gsm8k_final_answer_takes_what_follows_the_last_marker():
    assert final_answer("a #### 1 then #### 2 ") == "2"
    assert final_answer("no marker") == "no marker"


def test_unreadable_reference_is_counted_not_fatal():
    stats = RewardStats()
    assert score_batch(MATH, ["\\boxed{3}", "\\boxed{3}"], ["3", "}{"], stats) == [1.0, 0.0]
    assert stats.errors == 1 and "not a mathematical expression" in stats.first_error
