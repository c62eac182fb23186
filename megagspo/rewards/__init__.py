"""Reward registry: verifiers `fn(response: str, answer: str) -> float` in [0, 1].

`score_batch` never lets a verifier crash the run: an exception, NaN/inf or non-number scores 0 and is
counted in `RewardStats.errors`; values outside [0, 1] are clamped and counted in `RewardStats.clamped`.
"""

from __future__ import annotations

import math as _math
import re
from dataclasses import dataclass
from typing import Callable, Dict

_REWARDS: Dict[str, Callable[[str, str], float]] = {}


def register_reward(name: str):
    def deco(fn):
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return deco


def available_rewards() -> list:
    return sorted(_REWARDS)


def get_reward(name: str) -> Callable[[str, str], float]:
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid names: {', '.join(available_rewards())}") from None


@register_reward("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1 when the response equals the answer after stripping surrounding whitespace."""
    return float(response.strip() == answer.strip())


@register_reward("digit_match")
def digit_match(response: str, answer: str) -> float:
    """Partial credit for short numeric answers: 1 for an exact match, else the fraction of answer characters
    matched position by position (right-aligned, as digits of a number), halved — so an exact answer is
    always worth strictly more than any near miss."""
    response, answer = response.strip(), answer.strip()
    if response == answer:
        return 1.0
    if not answer:
        return 0.0
    width = max(len(answer), len(response))
    hits = sum(1 for a, b in zip(response.rjust(width), answer.rjust(width)) if a == b and a != " ")
    return 0.5 * hits / width


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register_reward("last_number")
def last_number(response: str, answer: str) -> float:
    """1 when the last number in the response equals the answer numerically (GSM8K-style)."""
    found = _NUMBER.findall(response.replace(",", ""))
    if not found:
        return 0.0
    return float(abs(float(found[-1]) - float(answer.replace(",", ""))) < 1e-9)


@register_reward("math")
def math_verified(response: str, answer: str) -> float:
    """1 when the response's final answer equals the answer mathematically (math-verify; GSM8K "####" too)."""
    from .math_answers import math_reward

    return math_reward(response, answer)


@dataclass
class RewardStats:
    errors: int = 0
    clamped: int = 0
    first_error: str = ""


def score_batch(fn: Callable[[str, str], float], responses, answers, stats: RewardStats | None = None) -> list:
    stats = stats if stats is not None else RewardStats()
    out = []
    for response, answer in zip(responses, answers):
        try:
            value = float(fn(response, answer))
        except Exception as exc:  # noqa: BLE001 - a verifier failure scores 0 and is counted
            stats.errors += 1
            stats.first_error = stats.first_error or f"{type(exc).__name__}: {exc}"
            out.append(0.0)
            continue
        if not _math.isfinite(value):
            stats.errors += 1
            stats.first_error = stats.first_error or f"non-finite reward {value!r}"
            out.append(0.0)
            continue
        if value < 0.0 or value > 1.0:
            stats.clamped += 1
            value = min(max(value, 0.0), 1.0)
        out.append(value)
    return out


__all__ = ["RewardStats", "available_rewards", "exact_match", "get_reward", "last_number", "math_verified",
           "register_reward", "score_batch"]
