"""The `math` reward: a response is right when its final answer equals the reference mathematically,
decided by Hugging Face's math-verify (LaTeX and plain expressions, `\\boxed{}` answers, fractions,
decimals, thousands separators, sets and intervals).

Answers in GSM8K's style ("... #### 72") count by what follows the last "####", on both sides: a reference
taken straight from GSM8K's `answer` field, and a response that ends the same way.

math-verify's own time limits use SIGALRM and would replace the trainer's (`reward.timeout_s`, which wraps
every verifier), so they are switched off here and the trainer's limit is the one that applies.
"""

from __future__ import annotations

import logging

_GSM8K_MARK = "####"


def final_answer(text: str) -> str:
    """The text after the last GSM8K "####" marker, or the whole text when there is none."""
    return text.rsplit(_GSM8K_MARK, 1)[1].strip() if _GSM8K_MARK in text else text


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise RuntimeError("reward 'math' needs math-verify (pinned in requirements/base.txt; run make install)") \
            from None
    # Only its "timeout disabled" notice goes to warning level; parse failures are logged at debug.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def _parse_reference(math_verify, answer: str) -> list:
    """A reference answer is the answer itself, never a sentence to search: boxed first (so `x^2`, `1/2`,
    `\\frac{1}{2}` parse as expressions), then as written."""
    parsed = math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    return parsed or math_verify.parse(answer, parsing_timeout=None)


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference mathematically, else 0.0."""
    math_verify = _math_verify()
    gold = _parse_reference(math_verify, final_answer(answer).strip())
    if not gold:
        raise ValueError(f"reference answer {answer[:80]!r} is not a mathematical expression math-verify reads")
    predicted = math_verify.parse(final_answer(response), parsing_timeout=None)
    if not predicted:
        return 0.0
    return float(math_verify.verify(gold, predicted, timeout_seconds=None))
