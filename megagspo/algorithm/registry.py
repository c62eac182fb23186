"""Loss registry: interchangeable policy losses by name, each with its own Config dataclass, and the one
place where the run config's rl sections become a loss's validated Config.

A registered loss is `fn(batch: PackedBatch, config) -> (loss, metrics)`; `fn.Config` is its config
class. Unknown names raise with the list of valid ones.

    loss_cfg = build_loss_config(cfg.rl)        # the loss's validated Config (megagspo.kernels.policy_losses.build_loss
                                                # adds the torch or fused-kernel function: the trainer's route)

The run config's sections are the loss Config's parts: rl.loss holds the loss's name and its own fields
(clip_low, clip_high, dual_clip, aggregation, validate) under the same names, rl.kl is its KLConfig and
rl.old_policy its OldPolicyConfig; rl.advantage is the GroupAdvantageConfig of eq. 7 as it is. A field of
rl.loss that the chosen loss lacks is refused when it is set away from its default, naming the losses that
take it. The built-in losses register themselves when `megagspo.algorithm.losses` is imported, which the package
`megagspo.algorithm` does before any of its modules is used (this module never imports the losses back).
This module stays free of megagspo.config (the algorithm core imports no run-config code): `rl_cfg` is any
object with those sections as attributes, and errors are LossOptionError (a ValueError) naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict

_LOSSES: Dict[str, Callable] = {}


class LossOptionError(ValueError):
    """An `rl.*` loss option is invalid or does not apply to the chosen loss; the message names the key."""


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
    """Registered loss names, sorted."""
    return sorted(_LOSSES)


def registered_losses() -> list:
    """Registered loss names in registration order (gspo, gspo_token, grpo): the order the docs use."""
    return list(_LOSSES)


def get_loss(name: str) -> Callable:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(available_losses())}") from None


def make_loss_config(name: str, **fields):
    """Build and validate the Config of loss `name` from plain fields (e.g. a YAML mapping)."""
    return get_loss(name).Config(**fields)


# ------------------------------------------------------------------------------- the rl sections -> Config

def config_paths(config_cls: type, prefix: str = "") -> Dict[str, Any]:
    """Every leaf field of a (nested) Config dataclass as {dotted path: default}."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            out.update(config_paths(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = default
    return out


# rl.loss's fields that are not the loss Config's: its name and which implementation computes it
_NOT_LOSS_FIELDS = ("name", "impl")


def loss_option_keys(name: str) -> list:
    """The rl.loss.* keys that loss `name` reads (its Config's own fields; kl and old_policy are sections)."""
    return [f.name for f in dataclasses.fields(get_loss(name).Config) if f.name not in ("kl", "old_policy")]


def build_loss_config(rl_cfg):
    """The validated Config of loss `rl_cfg.loss.name`: the fields of rl.loss it has, rl.kl and rl.old_policy.
    A field of rl.loss the named loss lacks, set away from rl.loss's default, is refused naming the losses that
    take it (rl.loss.dual_clip with gspo). No kernels are imported."""
    section = rl_cfg.loss
    name = section.name
    try:
        fn = get_loss(name)
    except ValueError as exc:
        raise LossOptionError(f"rl.loss.name: {exc}") from None
    takes = loss_option_keys(name)
    defaults = type(section)()
    fields: Dict[str, Any] = {"kl": rl_cfg.kl, "old_policy": rl_cfg.old_policy}
    for f in dataclasses.fields(section):
        if f.name in _NOT_LOSS_FIELDS:
            continue
        value = getattr(section, f.name)
        if f.name in takes:
            fields[f.name] = value
        elif value != getattr(defaults, f.name):
            owners = [n for n in registered_losses() if f.name in loss_option_keys(n)]
            raise LossOptionError(
                f"rl.loss.{f.name} = {value!r} applies to rl.loss.name = {' | '.join(owners)} only, not {name!r}; "
                f"rl.loss.name = {name!r} takes: {', '.join('rl.loss.' + k for k in takes)}")
    try:
        return fn.Config(**fields)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace(f"{fn.Config.__name__}.", "rl.loss.")
        raise LossOptionError(f"rl.loss.name = {name!r}: {message}") from None
