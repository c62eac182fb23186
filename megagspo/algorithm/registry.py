"""Loss registry: interchangeable policy losses by name, each with its own Config dataclass, and the one
place where the run config's `rl.*` keys become a loss and its validated Config.

A registered loss is `fn(batch: PackedBatch, config) -> (loss, metrics)`; `fn.Config` is its config
class. Unknown names raise with the list of valid ones.

    loss_cfg = build_loss_config(cfg.rl)        # the loss's validated Config (megagspo.kernels.policy_losses.build_loss
                                                # adds the torch or fused-kernel function: the trainer's route)
    adv_cfg = build_advantage_config(cfg.rl)    # group advantages (eq. 7)

The run config is flat (`rl.clip_low`, `rl.kl_coef`, `rl.dual_clip`, ...), one key per option, so recipes,
command-line overrides (`rl.dual_clip=3`), ablation arms and the resume check all address an option the
same way. LOSS_OPTION_KEYS maps each `rl.*` key onto a field (dotted: `kl.coef`) of the loss Configs; a
key whose field the chosen loss lacks is refused when it is set away from its default, naming the losses
that take it. Every field of every registered Config has a key (tests/test_config_loss_options.py).
The built-in losses register themselves when `megagspo.algorithm.losses` is imported, which the package
`megagspo.algorithm` does before any of its modules is used (this module never imports the losses back).
This module stays free of megagspo.config (the algorithm core imports no run-config code): `rl_cfg` is any
object with the keys as attributes, and errors are LossOptionError (a ValueError) naming the `rl.*` key.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict

from .advantages import GroupAdvantageConfig

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


# ------------------------------------------------------------------------------------ rl.* keys -> Config

# rl key -> (loss Config field, dotted for nested configs). One key per concept; the trainer reads
# rl.kl_coef (a reference model exists only when > 0) and rl.old_logp (the recompute pass) itself too.
LOSS_OPTION_KEYS: Dict[str, str] = {
    "clip_low": "clip_low",                            # eq. 6 / eq. 2: lower clip 1 - clip_low
    "clip_high": "clip_high",                          # upper clip 1 + clip_high
    "dual_clip": "dual_clip",                          # GRPO: bound c * A_t for A_t < 0 (null = off)
    "aggregation": "aggregation",                      # GRPO: seq_mean_token_mean (eq. 2) | token_mean
    "kl_coef": "kl.coef",                              # loss += kl_coef * KL(pi_theta || pi_ref); 0 = off
    "kl_estimator": "kl.estimator",                    # k1 | k3 (algorithm/kl.py)
    "old_logp": "old_policy.source",                   # recompute | rollout (§5.4)
    "rollout_correction": "old_policy.rollout_correction",  # none | seq_tis | token_tis | seq_mask_geo | ...
    "rollout_correction_cap": "old_policy.correction_cap",  # C of seq_tis / token_tis
    "seq_mask_low": "old_policy.seq_mask_low",         # seq_mask_geo's band for exp(mean log pi_old/pi_rollout)
    "seq_mask_high": "old_policy.seq_mask_high",
    "token_mask_low": "old_policy.token_mask_low",     # token_mask's band for pi_old/pi_rollout per token
    "token_mask_high": "old_policy.token_mask_high",
    "opsm_delta": "old_policy.opsm_delta",             # opsm: drift threshold of negative-advantage sequences
    "loss_input_checks": "validate",                   # check every batch tensor (shapes, finiteness)
}

# rl key -> GroupAdvantageConfig field (eq. 7: A_i = (r_i - mean r) / (std r + eps)).
ADVANTAGE_OPTION_KEYS: Dict[str, str] = {
    "scale_adv_by_std": "scale_by_std",
    "adv_eps": "eps",
    "adv_unbiased_std": "unbiased_std",
}


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


def loss_option_keys(name: str) -> list:
    """The rl.* keys that loss `name` reads."""
    paths = config_paths(get_loss(name).Config)
    return [key for key, path in LOSS_OPTION_KEYS.items() if path in paths]


def _nest(flat: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _rl_default(rl_cfg, key: str) -> Any:
    """The value `key` has when a recipe does not set it (the rl config dataclass's default)."""
    if dataclasses.is_dataclass(rl_cfg):
        for f in dataclasses.fields(rl_cfg):
            if f.name == key:
                return f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return None


# Nested Configs of the losses and the field that holds them (GSPOConfig.kl is a KLConfig, ...).
_NESTED_OWNERS = {"KLConfig": "kl.", "OldPolicyConfig": "old_policy."}


def _as_rl_keys(message: str, keys: Dict[str, str]) -> str:
    """'GRPOConfig.dual_clip must be ...' -> 'rl.dual_clip must be ...': errors name the key a user sets."""
    key_of = {path: key for key, path in keys.items()}

    def swap(m: re.Match) -> str:
        key = key_of.get(_NESTED_OWNERS.get(m.group(1), "") + m.group(2))
        return f"rl.{key}" if key else m.group(0)

    message = re.sub(r"\b([A-Z][A-Za-z]*Config)\.([a-z_]+)", swap, message)
    # OldPolicyConfig's messages name its bare field `source=`, which a recipe spells rl.old_logp
    return re.sub(r"\bsource=", "rl.old_logp=", message) if "old_logp" in keys else message


def build_loss_config(rl_cfg):
    """The validated Config of loss `rl_cfg.loss` from the rl.* keys (no kernels imported)."""
    name = rl_cfg.loss
    try:
        fn = get_loss(name)
    except ValueError as exc:
        raise LossOptionError(f"rl.loss: {exc}") from None
    paths = config_paths(fn.Config)
    fields: Dict[str, Any] = {}
    for key, path in LOSS_OPTION_KEYS.items():
        if not hasattr(rl_cfg, key):
            continue
        value = getattr(rl_cfg, key)
        if path in paths:
            fields[path] = value
        elif value != _rl_default(rl_cfg, key):
            takes = [n for n in registered_losses() if path in config_paths(get_loss(n).Config)]
            raise LossOptionError(
                f"rl.{key} = {value!r} applies to rl.loss = {' | '.join(takes)} only, not {name!r}; "
                f"rl.loss = {name!r} takes: {', '.join('rl.' + k for k in loss_option_keys(name))}")
    try:
        return fn.Config(**_nest(fields))
    except (TypeError, ValueError) as exc:
        raise LossOptionError(f"rl.loss = {name!r}: {_as_rl_keys(str(exc), LOSS_OPTION_KEYS)}") from None


def build_advantage_config(rl_cfg):
    """GroupAdvantageConfig (eq. 7) from the rl.* keys; pass its fields to group_advantages."""
    fields = {field: getattr(rl_cfg, key) for key, field in ADVANTAGE_OPTION_KEYS.items() if hasattr(rl_cfg, key)}
    try:
        return GroupAdvantageConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise LossOptionError(_as_rl_keys(str(exc), ADVANTAGE_OPTION_KEYS)) from None
