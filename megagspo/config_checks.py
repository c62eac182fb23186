"""The checks every config section runs on construction, each raising a ConfigError that names the key
(`owner.name`), and the deferral of missing-path checks during a dry run (a cluster recipe checked on a box that
lacks the cluster's files)."""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Any

from megagspo.errors import ConfigError
from megagspo.errors import show_value as _show

# A dry run validates a cluster recipe on a box that lacks the cluster's files: there, a missing data,
# tokenizer or checkpoint path is recorded (and reported) instead of raising. Real runs always check.
_DEFERRED_PATHS: contextvars.ContextVar = contextvars.ContextVar("megagspo_deferred_paths", default=None)


def path_present(key: str, path: str, kind: str = "any") -> bool:
    exists = {"any": os.path.exists, "file": os.path.isfile, "dir": os.path.isdir}[kind](path)
    deferred = _DEFERRED_PATHS.get()
    if not exists and deferred is not None:
        deferred.append((key, path))
        return True
    return exists


@contextlib.contextmanager
def deferred_path_checks():
    """Within this block missing paths are collected in the yielded list instead of raising."""
    missing: list = []
    token = _DEFERRED_PATHS.set(missing)
    try:
        yield missing
    finally:
        _DEFERRED_PATHS.reset(token)


def require(owner: str, name: str, ok: bool, value: Any, what: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}.{name} must be {what}, got {_show(value)}")


def pos_int(owner: str, name: str, value: Any) -> None:
    require(owner, name, isinstance(value, int) and not isinstance(value, bool) and value > 0, value,
             "a positive integer")


def nonneg_int(owner: str, name: str, value: Any) -> None:
    require(owner, name, isinstance(value, int) and not isinstance(value, bool) and value >= 0, value,
             "an integer >= 0")


def num(owner: str, name: str, value: Any, lo: float = -math.inf, hi: float = math.inf,
         lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi
    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    require(owner, name, ok, value, f"a finite number in {rng}")


def choice(owner: str, name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{owner}.{name} = {_show(value)} is not valid; valid values: {', '.join(map(str, choices))}")
