"""Loss registry: interchangeable policy losses by name, each with its own Config dataclass.

A registered loss is `fn(batch: PackedBatch, config) -> (loss, metrics)`; `fn.Config` is its config
class. Unknown names raise with the list of valid ones.
"""

from __future__ import annotations

from typing import Callable, Dict

_LOSSES: Dict[str, Callable] = {}


def register_loss(name: str, config_cls: type) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        if name in _LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        fn.Config = config_cls
        fn.loss_name = name
        _LOSSES[name] = fn
        return fn

    return deco


def available_losses() -> list:
    return sorted(_LOSSES)


def get_loss(name: str) -> Callable:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(available_losses())}") from None


def make_loss_config(name: str, **fields):
    """Build and validate the Config of loss `name` from plain fields (e.g. a YAML mapping)."""
    return get_loss(name).Config(**fields)
