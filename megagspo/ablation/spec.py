"""An ablation recipe: a base training recipe, the arms (each a few overrides of it), the seeds.

    name: tiny_cpu_ablation
    base: ../tiny_cpu.yaml            # relative to this file
    seeds: [0, 1, 2]
    cold_start: sft                   # sft: one cold-start SFT per seed, shared by every arm | recipe: the
                                      # base recipe's model.init_from is the cold start (no SFT is run)
    common: {rl.steps: 400}           # overrides applied to every run (cold starts included)
    arms:
      gspo:    {rl.loss.name: gspo, rl.loss.clip_low: 0.003, rl.loss.clip_high: 0.004}
      grpo_r2: {rl.loss.name: grpo, rl.loss.clip_low: 0.2, rl.loss.clip_high: 0.27, rl.routing_replay: r2}
    settings:                         # optional second dimension: every arm runs under every setting
      on_policy: {rl.batch.mini_batches: 1}
      off_policy_4x: {rl.batch.mini_batches: 4}

Without `settings` the cells are the arms (folders <out>/<arm>/seed<s>). With them the cells are the product
arms x settings, one cell per (arm, setting), named "<setting>/<arm>" (folders <out>/<setting>/<arm>/seed<s>):
a setting is a second set of overrides, checked by the same rules as an arm's, and an arm and a setting may not
set the same key (which of the two would win is not something a recipe should leave to the reader).

Arms differ only in what they name: every arm of a seed starts from the same cold-start checkpoint with
the same seed, hence the same data order and the same first rollouts. The harness owns the keys that make
that true (seed, name, log.out_dir, model.init_from, checkpoint.resume); an arm may not touch them, nor the model,
data or SFT sections, which the shared cold start depends on (put those in `common`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import yaml

from megagspo.config import (Config, ConfigError, deferred_path_checks, flatten_keys, load_config,
                             read_yaml_mapping)
from megagspo.config_moves import move_old_keys

COLD_START_MODES = ("sft", "recipe")
# Keys the harness sets itself, per run.
_HARNESS_KEYS = ("seed", "name", "log.out_dir", "model.init_from", "checkpoint.resume")
# Sections an arm may not vary: the shared cold start and the data order depend on them.
_SHARED_PREFIXES = ("model.", "data.", "sft.", "parallel.", "threads")
_ARM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_SPEC_KEYS = ("name", "base", "seeds", "cold_start", "common", "arms", "settings", "out_dir")


def last_wins(overrides: List[str]) -> List[str]:
    """The overrides without those a later one of the same key replaces (the config is the same: the last value
    wins either way), so that a printed command names each key once."""
    last = {o.split("=", 1)[0]: i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[o.split("=", 1)[0]] == i]


def _override_list(flat: Dict[str, object]) -> List[str]:
    """{'rl.loss.clip_low': 0.2} -> ['rl.loss.clip_low=0.2'] (values as YAML scalars, so they parse back unchanged)."""
    out = []
    for key, value in flat.items():
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        if text.endswith("\n...") or text.endswith("..."):
            text = text.rsplit("\n", 1)[0].strip()
        out.append(f"{key}={text}")
    return out


@dataclass
class AblationSpec:
    name: str
    base: str                                   # path of the base training recipe (resolved)
    arms: Dict[str, Dict[str, object]]          # arm -> flat {dotted key: value}
    seeds: List[int] = field(default_factory=lambda: [0])
    cold_start: str = "sft"
    common: Dict[str, object] = field(default_factory=dict)
    out_dir: str = ""                           # "" = runs/ablations/<name>
    settings: Dict[str, Dict[str, object]] = field(default_factory=dict)  # setting -> flat overrides; {} = none

    def __post_init__(self) -> None:
        if not self.name or not re.match(r"^[A-Za-z0-9_.-]+$", self.name):
            raise ConfigError(f"ablation name {self.name!r} must be a non-empty file-name-safe string")
        if not os.path.isfile(self.base):
            raise ConfigError(f"ablation base recipe {self.base!r} does not exist")
        if self.cold_start not in COLD_START_MODES:
            raise ConfigError(f"ablation cold_start = {self.cold_start!r}; valid: {', '.join(COLD_START_MODES)}")
        if not self.seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.seeds):
            raise ConfigError(f"ablation seeds must be a non-empty list of non-negative integers, got {self.seeds!r}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"ablation seeds {self.seeds} repeat a seed")
        if not self.arms:
            raise ConfigError("ablation arms: at least one arm is needed")
        for arm, overrides in self.arms.items():
            if not _ARM_NAME.match(arm) or arm == "cold_start":
                raise ConfigError(f"ablation arm name {arm!r} must match [a-z][a-z0-9_]* and not be 'cold_start'")
            for key in overrides:
                self._check_key(f"arms.{arm}", key, shared_ok=False)
        for setting, overrides in self.settings.items():
            if not _ARM_NAME.match(setting) or setting == "cold_start":
                raise ConfigError(f"ablation setting name {setting!r} must match [a-z][a-z0-9_]* and not be "
                                  "'cold_start'")
            if setting in self.arms:
                raise ConfigError(f"ablation setting {setting!r} has the name of an arm; name them apart")
            for key in overrides:
                self._check_key(f"settings.{setting}", key, shared_ok=False)
                both = [arm for arm, arm_overrides in self.arms.items() if key in arm_overrides]
                if both:
                    raise ConfigError(f"ablation arm {both[0]!r} and setting {setting!r} both set {key!r}; set it "
                                      "in one dimension only")
        for key in self.common:
            self._check_key("common", key, shared_ok=True)
        if not self.out_dir:
            self.out_dir = os.path.join("runs", "ablations", self.name)

    @staticmethod
    def _check_key(where: str, key: str, shared_ok: bool) -> None:
        if key in _HARNESS_KEYS:
            raise ConfigError(f"ablation {where}: {key!r} is set by the harness per run ({', '.join(_HARNESS_KEYS)}); "
                              "use `seeds` / `out_dir` / the base recipe instead")
        if not shared_ok and (key.startswith(_SHARED_PREFIXES) or key == "threads"):
            raise ConfigError(f"ablation {where}: {key!r} would change the model, data or cold start between arms; "
                              "arms may vary only the RL algorithm (rl.*, rollout.*, reward.*); put it in `common`")

    # ---- the runs -----------------------------------------------------------------------------------------
    def arm_names(self) -> List[str]:
        return list(self.arms)

    def cells(self) -> List[str]:
        """The cell names, setting-major: the arms themselves without settings, else "<setting>/<arm>" for
        every pair (a partial ablation then holds whole settings)."""
        if not self.settings:
            return list(self.arms)
        return [f"{setting}/{arm}" for setting in self.settings for arm in self.arms]

    def split_cell(self, cell: str) -> Tuple[str, str]:
        """cell name -> (arm, setting); setting is "" without settings."""
        setting, _, arm = cell.rpartition("/")
        if arm not in self.arms or (setting or self.settings) and setting not in self.settings:
            raise ConfigError(f"{cell!r} is not a cell of ablation {self.name!r}; cells: {', '.join(self.cells())}")
        return arm, setting

    def cell_spec_overrides(self, cell: str) -> Dict[str, object]:
        """What this cell sets on top of `common`: its arm's overrides, then its setting's (disjoint keys)."""
        arm, setting = self.split_cell(cell)
        return {**self.arms[arm], **(self.settings[setting] if setting else {})}

    def cold_start_dir(self, seed: int) -> str:
        return os.path.join(self.out_dir, "cold_start", f"seed{seed}")

    def cell_dir(self, cell: str, seed: int) -> str:
        return os.path.join(self.out_dir, *cell.split("/"), f"seed{seed}")

    def cold_start_overrides(self, seed: int, extra: List[str]) -> List[str]:
        return last_wins(_override_list(self.common) + list(extra) +
                         [f"seed={seed}", f"name=seed{seed}", f"log.out_dir={os.path.join(self.out_dir, 'cold_start')}",
                          "rl.steps=0"])

    def cell_overrides(self, cell: str, seed: int, extra: List[str]) -> List[str]:
        """Overrides of the base recipe for one (cell, seed) run; `extra` (the command line's) apply to every run,
        the cell's own (arm, then setting) after them."""
        out = _override_list(self.common) + list(extra) + _override_list(self.cell_spec_overrides(cell))
        out += [f"seed={seed}", f"name=seed{seed}", f"log.out_dir={os.path.dirname(self.cell_dir(cell, seed))}",
                "checkpoint.resume=auto"]
        if self.cold_start == "sft":
            out += [f"model.init_from={os.path.join(self.cold_start_dir(seed), 'checkpoint.pt')}", "sft.steps=0"]
        return last_wins(out)

    def cell_config(self, cell: str, seed: int, extra: List[str], missing: Optional[list] = None) -> Config:
        """The run's config; paths absent here (the cold start not written yet, cluster paths) are not errors:
        they are appended to `missing` as (key, path) when given."""
        with deferred_path_checks() as absent:
            cfg = load_config(self.base, self.cell_overrides(cell, seed, extra))
        if missing is not None:
            missing.extend(absent)
        return cfg

    def cold_start_config(self, seed: int, extra: List[str]) -> Config:
        return load_config(self.base, self.cold_start_overrides(seed, extra))

    def validate_runs(self, extra: List[str]) -> Dict[str, Config]:
        """Build every run's config before any compute: a bad key names the cell and the key. -> {cell: cfg}."""
        configs = {}
        for cell in self.cells():
            try:
                configs[cell] = self.cell_config(cell, self.seeds[0], extra)
            except ConfigError as exc:
                what = "arm" if "/" not in cell else "cell"
                raise ConfigError(f"ablation {what} {cell!r}: {exc}") from None
        if self.cold_start == "sft":
            cfg = self.cold_start_config(self.seeds[0], extra)
            if cfg.sft.steps == 0:
                raise ConfigError("ablation cold_start = 'sft' but the base recipe has sft.steps = 0; use "
                                  "cold_start: recipe (model.init_from is the cold start) or set sft.steps")
        else:
            first = next(iter(configs.values()))
            if first.sft.steps:
                raise ConfigError("ablation cold_start = 'recipe' runs no shared SFT, but the base recipe has "
                                  f"sft.steps = {first.sft.steps}: each arm would train its own cold start. Set "
                                  "sft.steps: 0 (in `common`) or use cold_start: sft")
        return configs


def _flat_mapping(raw, what: str, example: str) -> Dict[str, Dict[str, object]]:
    """arms / settings: name -> mapping of overrides (nested or dotted), flattened."""
    if not isinstance(raw, dict):
        raise ConfigError(f"ablation {what}s must be a mapping of {what} name -> overrides, got {raw!r}")
    out = {}
    for name, overrides in raw.items():
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError(f"ablation {what} {name!r} must map keys to values (e.g. {example}), got {overrides!r}")
        out[str(name)] = flatten_keys(move_old_keys(overrides or {}, f"ablation {what} {name!r}"))
    return out


def load_ablation(path: str, out_dir: Optional[str] = None, seeds: Optional[List[int]] = None,
                  arms: Optional[List[str]] = None, settings: Optional[List[str]] = None) -> AblationSpec:
    """Read an ablation YAML; optionally restrict it to some seeds / arms / settings (names checked)."""
    raw = read_yaml_mapping(path, "ablation recipe")
    unknown = [k for k in raw if k not in _SPEC_KEYS]
    if unknown:
        raise ConfigError(f"unknown ablation key {unknown[0]!r} in {path}; valid keys: {', '.join(_SPEC_KEYS)}")
    for key in ("name", "base", "arms"):
        if key not in raw:
            raise ConfigError(f"ablation recipe {path!r} lacks {key!r}")
    arms_flat = _flat_mapping(raw["arms"], "arm", "rl.loss.name: grpo")
    settings_flat = _flat_mapping(raw.get("settings") or {}, "setting", "rl.batch.mini_batches: 4")
    common = raw.get("common") or {}
    if not isinstance(common, dict):
        raise ConfigError(f"ablation common must be a mapping of overrides, got {common!r}")
    base = os.path.normpath(os.path.join(os.path.dirname(path), str(raw["base"])))
    spec = AblationSpec(name=str(raw["name"]), base=base, arms=arms_flat, seeds=list(raw.get("seeds", [0])),
                        cold_start=str(raw.get("cold_start", "sft")),
                        common=flatten_keys(move_old_keys(common, "ablation common")),
                        out_dir=out_dir or str(raw.get("out_dir") or ""), settings=settings_flat)
    if seeds is not None:
        bad = [s for s in seeds if s not in spec.seeds]
        if bad:
            raise ConfigError(f"--seeds {bad} are not in the recipe's seeds {spec.seeds}")
        spec = dataclasses.replace(spec, seeds=list(seeds))
    if arms is not None:
        bad = [a for a in arms if a not in spec.arms]
        if bad:
            raise ConfigError(f"--arms {bad[0]!r} is not an arm of {path}; arms: {', '.join(spec.arms)}")
        spec = dataclasses.replace(spec, arms={a: spec.arms[a] for a in arms})
    if settings is not None:
        bad = [s for s in settings if s not in spec.settings]
        if bad:
            raise ConfigError(f"--settings {bad[0]!r} is not a setting of {path}; settings: "
                              f"{', '.join(spec.settings) or '(none)'}")
        spec = dataclasses.replace(spec, settings={s: spec.settings[s] for s in settings})
    return spec
