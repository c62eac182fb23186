"""Reward registry: verifiers `fn(response: str, answer: str) -> float` in [0, 1].

`score_batch` never lets a verifier crash the run: an exception, NaN/inf or non-number scores 0 and is
counted in `RewardStats.errors`; a call cut off at `reward.timeout_s` (megagspo.rewards.bounded: a worker process
killed at its deadline) is an error and is also counted in `RewardStats.timeouts`; values outside [0, 1] are
clamped and counted in `RewardStats.clamped`.

A verifier marked `fn.in_process = True` cannot hang (linear-time pure Python) and runs in the trainer's process;
every other one (the `math` reward, any user verifier) runs in the bounded worker. `fn.warmup()`, when present,
runs once in each new worker before its first timed call (imports, caches).
"""

from __future__ import annotations

import math as _math
import re
from dataclasses import dataclass
from typing import Callable, Dict

from .bounded import VerifierTimeout
from .math_answers import math_reward

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


exact_match.in_process = True


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


digit_match.in_process = True


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register_reward("last_number")
def last_number(response: str, answer: str) -> float:
    """1 when the last number in the response equals the answer numerically (GSM8K-style)."""
    found = _NUMBER.findall(response.replace(",", ""))
    if not found:
        return 0.0
    return float(abs(float(found[-1]) - float(answer.replace(",", ""))) < 1e-9)


last_number.in_process = True


@register_reward("math")
def math_verified(response: str, answer: str) -> float:
    """1 when the response's final answer equals the answer mathematically (math-verify; GSM8K "####" too)."""
    return math_reward(response, answer)


def _math_warmup() -> None:
    math_verified("\\boxed{1}", "1")  # imports math-verify and sympy in the worker, outside the timed calls


math_verified.warmup = _math_warmup


@dataclass
class RewardStats:
    errors: int = 0
    clamped: int = 0
    timeouts: int = 0      # calls cut off at reward.timeout_s (also counted in errors)
    first_error: str = ""


_ERROR_CHARS = 300  # a verifier's message may quote its input (a 10 MB response): the first line is cut to this


def score_batch(fn: Callable[[str, str], float], responses, answers, stats: RewardStats | None = None) -> list:
    stats = stats if stats is not None else RewardStats()
    out = []
    for response, answer in zip(responses, answers):
        try:
            value = float(fn(response, answer))
        except Exception as exc:  # noqa: BLE001 - a verifier failure scores 0 and is counted
            stats.errors += 1
            stats.timeouts += isinstance(exc, VerifierTimeout)
            if not stats.first_error:
                text = f"{type(exc).__name__}: {exc}"
                stats.first_error = text if len(text) <= _ERROR_CHARS else \
                    f"{text[:_ERROR_CHARS]}… ({len(text)} characters)"
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
