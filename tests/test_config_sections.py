"""The rl sections and the keys that moved onto them (megagspo.config_moves): every earlier key lands on an
existing path, an earlier recipe / override / saved run loads to the very Config the new spelling gives (with one
warning naming what moved), a source setting a key twice is refused, and a checkpoint's flat config compares
equal to the same run spelled in sections."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import yaml

from megagspo.checkpoint.run_folder import config_differences
from megagspo.checkpoint.state import DEFINING_KEYS, IMPLEMENTATION_KEYS, defining_differences
from megagspo.config import (Config, ConfigError, OptimConfig, config_from_dict, flatten_keys, load_config,
                             parse_overrides)
from megagspo.config_moves import MOVED_KEYS, MovedKeyWarning, move_old_keys, nest_keys, old_keys_in
from megagspo.policy.models import optimizer_settings
from helpers import REPO

TINY = os.path.join(REPO, "configs/tiny_cpu.yaml")
FLAT_TINY = os.path.join(REPO, "tests/assets/flat_keys_tiny_cpu.yaml")  # configs/tiny_cpu.yaml before the sections


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MovedKeyWarning)
        return fn(*args, **kwargs)


def test_every_moved_key_lands_on_a_key_that_exists_and_left_one_that_does_not():
    leaves = set(flatten_keys(Config().to_dict()))
    for old, new in MOVED_KEYS.items():
        assert new in leaves, f"{old} -> {new}: no such key"
        assert old not in leaves, f"{old} is still a key: moving it would hide it"
    assert len(set(MOVED_KEYS.values())) == len(MOVED_KEYS)  # one earlier key per key now


def test_the_earlier_recipe_loads_to_the_same_config_with_one_warning_naming_the_moves():
    with pytest.warns(MovedKeyWarning) as caught:
        earlier = load_config(FLAT_TINY)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert FLAT_TINY in message and "rl.lr -> rl.optim.lr" in message and "rl.loss -> rl.loss.name" in message
    assert "sft.lr -> sft.optim.lr" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", MovedKeyWarning)  # the recipes in the repository use the sections
        now = load_config(TINY)
    assert earlier == now
    assert now.rl.optim.lr == 1e-4 and now.sft.optim.lr == 3e-3 and now.rl.loss.name == "gspo"
    assert now.sft.optim.schedule == "cosine" and now.rl.optim.schedule == "constant"  # each section's own default


@pytest.mark.parametrize("recipe, overrides", [
    (TINY, ["rl.lr=0.0005", "rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.27", "sft.warmup_steps=3"]),
    (FLAT_TINY, ["rl.optim.lr=0.0005", "rl.loss.name=grpo", "rl.loss.clip_low=0.2", "rl.loss.clip_high=0.27",
                 "sft.optim.warmup_steps=3"]),
])
def test_overrides_in_either_spelling_reach_a_recipe_in_the_other(recipe, overrides):
    """Each source is moved on its own before they merge, so an old-style override of a sectioned recipe (and
    the reverse) overrides the key it names rather than landing beside it."""
    cfg = _quiet(load_config, recipe, overrides)
    assert (cfg.rl.optim.lr, cfg.rl.loss.name, cfg.rl.loss.clip_low, cfg.sft.optim.warmup_steps) == \
        (0.0005, "grpo", 0.2, 3)
    assert cfg.rl.optim.warmup_steps == 10 and cfg.sft.optim.lr == 3e-3  # the recipe's other values stay


def test_one_file_setting_a_key_under_both_names_is_refused_and_the_last_override_wins():
    """Within one mapping (a recipe, an arm) which value was meant cannot be told: refused. Overrides are a
    sequence, and the last one of a key wins whichever name each uses, as for any repeated override."""
    with pytest.raises(ConfigError, match=r"recipe.yaml sets both rl.kl_coef .* and rl.kl.coef"):
        config_from_dict({"rl": {"kl_coef": 0.1, "kl": {"coef": 0.2}}}, where="recipe.yaml")
    with pytest.raises(ConfigError, match="sets both rl.loss .* and rl.loss.name"):
        config_from_dict({"rl": {"loss": "grpo", "loss.name": "gspo"}})
    assert _quiet(load_config, TINY, ["rl.kl_coef=0.1", "rl.kl.coef=0.2"]).rl.kl.coef == 0.2
    assert _quiet(load_config, TINY, ["rl.kl.coef=0.2", "rl.kl_coef=0.1"]).rl.kl.coef == 0.1
    assert _quiet(load_config, TINY, ["rl.loss=grpo", "rl.loss.name=gspo_token"]).rl.loss.name == "gspo_token"


def test_move_old_keys_leaves_what_it_does_not_know_to_the_loader():
    tree = {"rl": {"loss": {"name": "grpo"}, "steps": 3}, "seed": 1}
    assert move_old_keys(tree, "x") is tree and old_keys_in(tree) == {}
    assert move_old_keys([1], "x") == [1] and move_old_keys({"rl": None}, "x") == {"rl": None}
    moved = _quiet(move_old_keys, parse_overrides(["rl.rollout_correction=true", "rl.opsm_delta=0.1"]), "x")
    assert moved == {"rl": {"old_policy": {"correction": {"method": True, "opsm_delta": 0.1}}}}
    # `true` of recipes from before the correction menu is still seq_tis
    assert _quiet(load_config, TINY, ["rl.rollout_correction=true"]).rl.old_policy.correction.method == "seq_tis"


def test_sections_errors_name_the_path_the_recipe_used():
    with pytest.raises(ConfigError, match=r"sft.optim.lr must be a finite number in \(0.0, 1.0\]"):
        load_config(TINY, ["sft.optim.lr=3"])
    with pytest.raises(ConfigError, match=r"rl.optim.lr must be a finite number"):
        load_config(TINY, ["rl.optim.lr=3"])
    with pytest.raises(ConfigError, match=r"rl.kl.coef must be a finite number >= 0, got -1"):
        load_config(TINY, ["rl.kl.coef=-1"])
    with pytest.raises(ConfigError, match=r"rl.advantage.eps must be a finite number >= 0, got -1"):
        load_config(TINY, ["rl.advantage.eps=-1"])
    with pytest.raises(ConfigError, match="rl.old_policy.correction must be a mapping"):
        load_config(TINY, ["rl.old_policy.correction=seq_tis"])


def test_sft_optimizer_is_its_section_and_its_defaults_are_what_sft_always_ran():
    """SFT hard-coded AdamW betas (0.9, 0.99) and a cosine decay to 0.1 of its peak: its section's defaults."""
    sft = Config().sft.optim
    assert (sft.beta1, sft.beta2, sft.schedule, sft.min_lr_ratio, sft.lr, sft.warmup_steps) == \
        (0.9, 0.99, "cosine", 0.1, 3e-3, 10)
    cfg = load_config(TINY, ["sft.optim.beta2=0.95", "sft.optim.schedule=linear", "sft.optim.weight_decay=0.1"])
    settings = optimizer_settings(cfg.sft.optim)
    assert (settings.beta2, settings.weight_decay, settings.lr, settings.clip_grad) == (0.95, 0.1, 3e-3, 1.0)
    assert optimizer_settings(OptimConfig(lr=0.02, grad_clip=0.5)).clip_grad == 0.5


def _flat_dump(cfg: Config) -> dict:
    """A run's config.yaml as the code before the sections wrote it: every moved key at its earlier path."""
    back = {new: old for old, new in MOVED_KEYS.items()}
    return nest_keys({back.get(path, path): value for path, value in flatten_keys(dataclasses.asdict(cfg)).items()})


def test_a_run_saved_before_the_sections_is_the_same_run(tmp_path):
    """What a resume compares: the checkpoint's config (defining keys) and the run folder's config.yaml (every
    key). Saved with the flat keys, both equal the same run asked in sections; a real change is still named."""
    cfg = load_config(TINY, ["rl.kl.coef=0.1", "rl.old_policy.correction.method=token_mask"])
    saved = _flat_dump(cfg)
    assert "kl_coef" in saved["rl"] and "lr" in saved["sft"]  # it really is the earlier layout
    assert _quiet(defining_differences, saved, cfg.to_dict()) == []
    with open(tmp_path / "config.yaml", "w") as f:
        yaml.safe_dump(saved, f)
    assert _quiet(config_differences, str(tmp_path), cfg.to_dict()) == []
    changed = load_config(TINY, ["rl.kl.coef=0.2", "rl.old_policy.correction.method=token_mask"])
    assert _quiet(defining_differences, saved, changed.to_dict()) == \
        ["rl.kl.coef: 0.1 in the checkpoint, 0.2 now"]
    assert _quiet(config_differences, str(tmp_path), changed.to_dict()) == ["rl.kl.coef: 0.1 there, 0.2 asked"]


def test_defining_keys_are_section_prefixes():
    """What defines a run is named by section (every loss, KL, old-policy, advantage and filter key, now and
    when a field is added), with the implementation choices inside them carved out."""
    leaves = flatten_keys(Config().to_dict())
    for prefix in DEFINING_KEYS:
        assert any(k == prefix or k.startswith(prefix + ".") for k in leaves), prefix
    assert {"rl.loss.impl", "rl.loss.validate"} <= set(IMPLEMENTATION_KEYS)
    cfg = load_config(TINY)
    for override in ("rl.loss.impl=kernels", "rl.loss.validate=false", "rl.optim.lr=0.5", "rl.steps=3"):
        assert defining_differences(cfg.to_dict(), load_config(TINY, [override]).to_dict()) == [], override
    for override in ("rl.old_policy.correction.opsm_delta=0.5", "rl.filter.max_rounds=5", "rl.advantage.eps=0.1"):
        assert defining_differences(cfg.to_dict(), load_config(TINY, [override]).to_dict()), override


def test_the_keys_document_is_the_one_the_dataclasses_generate():
    """docs/configuration-keys.md lists every key, section and move as `tools/config_table.py` prints them from
    the code; a field added, renamed or moved without regenerating it fails here, naming the command."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_table", os.path.join(REPO, "tools/config_table.py"))
    config_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_table)
    with open(os.path.join(REPO, "docs/configuration-keys.md"), encoding="utf-8") as f:
        written = f.read()
    assert written == config_table.table(), \
        "docs/configuration-keys.md is stale: python tools/config_table.py > docs/configuration-keys.md"
    for old, new in MOVED_KEYS.items():
        assert f"| `{old}` | `{new}` |" in written
