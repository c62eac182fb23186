"""An ablation recipe: a base training recipe, the arms (each a few overrides of it), the seeds.

    name: tiny_cpu_ablation
    base: ../tiny_cpu.yaml            # relative to this file
    seeds: [0, 1, 2]
    cold_start: sft                   # sft: one cold-start SFT per seed, shared by every arm | recipe: the
                                      # base recipe's model.init_from is the cold start (no SFT is run)
    common: {rl.steps: 400}           # overrides applied to every run (cold starts included)
    arms:
      gspo:    {rl.loss: gspo, rl.clip_low: 0.003, rl.clip_high: 0.004}
      grpo_r2: {rl.loss: grpo, rl.clip_low: 0.2, rl.clip_high: 0.27, rl.routing_replay: r2}

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
from typing import Dict, List, Optional

import yaml

from megagspo.config import (Config, ConfigError, deferred_path_checks, flatten_keys, load_config,
                             read_yaml_mapping)

COLD_START_MODES = ("sft", "recipe")
# Keys the harness sets itself, per run.
_HARNESS_KEYS = ("seed", "name", "log.out_dir", "model.init_from", "checkpoint.resume")
# Sections an arm may not vary: the shared cold start and the data order depend on them.
_SHARED_PREFIXES = ("model.", "data.", "sft.", "parallel.", "threads")
_ARM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_SPEC_KEYS = ("name", "base", "seeds", "cold_start", "common", "arms", "out_dir")


def last_wins(overrides: List[str]) -> List[str]:
    """The overrides without those a later one of the same key replaces (the config is the same: the last value
    wins either way), so that a printed command names each key once."""
    last = {o.split("=", 1)[0]: i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[o.split("=", 1)[0]] == i]


def _override_list(flat: Dict[str, object]) -> List[str]:
    """{'rl.clip_low': 0.2} -> ['rl.clip_low=0.2'] (values as YAML scalars, so they parse back unchanged)."""
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

    def cold_start_dir(self, seed: int) -> str:
        return os.path.join(self.out_dir, "cold_start", f"seed{seed}")

    def cell_dir(self, arm: str, seed: int) -> str:
        return os.path.join(self.out_dir, arm, f"seed{seed}")

    def cold_start_overrides(self, seed: int, extra: List[str]) -> List[str]:
        return last_wins(_override_list(self.common) + list(extra) +
                         [f"seed={seed}", f"name=seed{seed}", f"log.out_dir={os.path.join(self.out_dir, 'cold_start')}",
                          "rl.steps=0"])

    def cell_overrides(self, arm: str, seed: int, extra: List[str]) -> List[str]:
        """Overrides of the base recipe for one (arm, seed) run; `extra` (the command line's) apply to every run."""
        out = _override_list(self.common) + list(extra) + _override_list(self.arms[arm])
        out += [f"seed={seed}", f"name=seed{seed}", f"log.out_dir={os.path.join(self.out_dir, arm)}",
                "checkpoint.resume=auto"]
        if self.cold_start == "sft":
            out += [f"model.init_from={os.path.join(self.cold_start_dir(seed), 'checkpoint.pt')}", "sft.steps=0"]
        return last_wins(out)

    def cell_config(self, arm: str, seed: int, extra: List[str], missing: Optional[list] = None) -> Config:
        """The run's config; paths absent here (the cold start not written yet, cluster paths) are not errors:
        they are appended to `missing` as (key, path) when given."""
        with deferred_path_checks() as absent:
            cfg = load_config(self.base, self.cell_overrides(arm, seed, extra))
        if missing is not None:
            missing.extend(absent)
        return cfg

    def cold_start_config(self, seed: int, extra: List[str]) -> Config:
        return load_config(self.base, self.cold_start_overrides(seed, extra))

    def validate_runs(self, extra: List[str]) -> Dict[str, Config]:
        """Build every run's config before any compute: a bad key names the arm and the key. -> {arm: cfg}."""
        configs = {}
        for arm in self.arms:
            try:
                configs[arm] = self.cell_config(arm, self.seeds[0], extra)
            except ConfigError as exc:
                raise ConfigError(f"ablation arm {arm!r}: {exc}") from None
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


def load_ablation(path: str, out_dir: Optional[str] = None, seeds: Optional[List[int]] = None,
                  arms: Optional[List[str]] = None) -> AblationSpec:
    """Read an ablation YAML; optionally restrict it to some seeds / arms (names checked)."""
    raw = read_yaml_mapping(path, "ablation recipe")
    unknown = [k for k in raw if k not in _SPEC_KEYS]
    if unknown:
        raise ConfigError(f"unknown ablation key {unknown[0]!r} in {path}; valid keys: {', '.join(_SPEC_KEYS)}")
    for key in ("name", "base", "arms"):
        if key not in raw:
            raise ConfigError(f"ablation recipe {path!r} lacks {key!r}")
    arms_raw = raw["arms"]
    if not isinstance(arms_raw, dict):
        raise ConfigError(f"ablation arms must be a mapping of arm name -> overrides, got {arms_raw!r}")
    arms_flat = {}
    for arm, overrides in arms_raw.items():
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError(f"ablation arm {arm!r} must map keys to values (e.g. rl.loss: grpo), got {overrides!r}")
        arms_flat[str(arm)] = flatten_keys(overrides or {})
    common = raw.get("common") or {}
    if not isinstance(common, dict):
        raise ConfigError(f"ablation common must be a mapping of overrides, got {common!r}")
    base = os.path.normpath(os.path.join(os.path.dirname(path), str(raw["base"])))
    spec = AblationSpec(name=str(raw["name"]), base=base, arms=arms_flat, seeds=list(raw.get("seeds", [0])),
                        cold_start=str(raw.get("cold_start", "sft")), common=flatten_keys(common),
                        out_dir=out_dir or str(raw.get("out_dir") or ""))
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
    return spec
