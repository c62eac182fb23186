"""Keys that moved: the flat `rl.*` (and `sft.*` optimizer) keys of earlier recipes, command-line overrides,
ablation arms and saved runs' config.yaml, mapped onto the sections that replaced them (megagspo.config).

One table, MOVED_KEYS, old dotted path -> new dotted path. `move_old_keys(tree, where)` rewrites a mapping
(nested or with dotted keys) and warns once per source, listing what moved, so an earlier recipe and a run
saved before the sections existed load and resume unchanged. Where a source sets both an old key and its new
path, it is refused naming both: which one was meant cannot be guessed.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

from megagspo.errors import ConfigError


class MovedKeyWarning(FutureWarning):
    """A config source uses a key from before the rl sections; it still works, under its new path."""


def _section(prefix: str, names: str, new_prefix: str) -> Dict[str, str]:
    return {f"{prefix}.{name}": f"{new_prefix}.{name}" for name in names.split()}


MOVED_KEYS: Dict[str, str] = {
    **_section("rl", "prompts_per_step group_size mini_batches micro_batch_size packing max_tokens_per_micro_batch",
               "rl.batch"),
    "rl.loss": "rl.loss.name",  # a scalar rl.loss (the loss's name); a mapping there is the new section
    **_section("rl", "clip_low clip_high dual_clip aggregation", "rl.loss"),
    "rl.loss_input_checks": "rl.loss.validate",
    "rl.loss_impl": "rl.loss.impl",
    "rl.kl_coef": "rl.kl.coef",
    "rl.kl_estimator": "rl.kl.estimator",
    "rl.old_logp": "rl.old_policy.source",
    "rl.rollout_correction": "rl.old_policy.correction.method",
    "rl.rollout_correction_cap": "rl.old_policy.correction.cap",
    **_section("rl", "seq_mask_low seq_mask_high token_mask_low token_mask_high opsm_delta", "rl.old_policy.correction"),
    "rl.scale_adv_by_std": "rl.advantage.scale_by_std",
    "rl.adv_eps": "rl.advantage.eps",
    "rl.adv_unbiased_std": "rl.advantage.unbiased_std",
    "rl.filter_groups": "rl.filter.enabled",
    "rl.filter_max_rounds": "rl.filter.max_rounds",
    "rl.lr": "rl.optim.lr",
    "rl.lr_schedule": "rl.optim.schedule",
    **_section("rl", "warmup_steps min_lr_ratio weight_decay beta1 beta2 grad_clip", "rl.optim"),
    "rl.eval_every": "rl.eval.every",
    "rl.eval_samples": "rl.eval.samples",
    **_section("sft", "lr warmup_steps weight_decay grad_clip", "sft.optim"),
}


def _flat(tree: dict, prefix: str = "") -> Dict[str, Any]:
    """Dotted leaves of a nested mapping; an empty mapping is kept as a leaf (an empty section)."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{path}."))
        else:
            out[path] = value
    return out


def nest_keys(flat: Dict[str, Any]) -> dict:
    """{'rl.loss.name': 'grpo'} -> {'rl': {'loss': {'name': 'grpo'}}}: dotted paths back into nested mappings."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def old_keys_in(tree: dict) -> Dict[str, str]:
    """{old path: new path} for every moved key `tree` sets (it is not changed)."""
    if not isinstance(tree, dict):
        return {}
    # a mapping at a moved key is the section that replaced it (rl.loss: {name: grpo}), not an old value
    return {k: MOVED_KEYS[k] for k, v in _flat(tree).items() if k in MOVED_KEYS and not isinstance(v, dict)}


def move_old_keys(tree: dict, where: str, warn: bool = True) -> dict:
    """`tree` with every MOVED_KEYS key at its new path (a new mapping; anything that is not a mapping, or
    holds no moved key, comes back as it is, for the loader to judge). Warns once, naming `where`."""
    moved = old_keys_in(tree)
    if not moved:
        return tree
    flat = _flat(tree)
    for old, new in moved.items():
        if new in flat:
            raise ConfigError(f"{where} sets both {old} (the key's name before the rl sections) and {new}, its "
                              f"name now: keep {new}")
        flat[new] = flat.pop(old)
    if warn:
        warn_moved(moved, where)
    return nest_keys(flat)


def warn_moved(moved: Dict[str, str], where: str, plural: bool = False) -> None:
    """The one warning of a source that used earlier keys: which, and their names now. plural: `where` names
    several things ("the overrides"), so the sentence says "use" / "they"."""
    listed = ", ".join(f"{old} -> {new}" for old, new in moved.items())
    verb, they = ("use", "they") if plural else ("uses", "it")
    warnings.warn(f"{where} {verb} {len(moved)} config key(s) from before the rl sections; they still work under "
                  f"their new names, which {they} should use: {listed}", MovedKeyWarning, stacklevel=4)
