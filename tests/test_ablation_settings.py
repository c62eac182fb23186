"""The ablation harness's second dimension (arms x settings) and the claim rules of megagspo.ablation.claims on
synthetic results whose answer is known. No training: recipes are only planned and validated."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import yaml

from megagspo.ablation import load_ablation, plan_runs
from megagspo.ablation.claims import (above_verdict, claims, compare_values, no_benefit_verdict)
from megagspo.ablation.results import ArmResult, CellResult
from megagspo.config import ConfigError, flatten_keys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"gspo": {"rl.loss.name": "gspo", "rl.loss.clip_low": 0.003, "rl.loss.clip_high": 0.004, "rl.routing_replay": "none"},
        "gspo_r3": {"rl.loss.name": "gspo", "rl.loss.clip_low": 0.003, "rl.loss.clip_high": 0.004, "rl.routing_replay": "r3"},
        "grpo": {"rl.loss.name": "grpo", "rl.loss.clip_low": 0.2, "rl.loss.clip_high": 0.27, "rl.routing_replay": "none"},
        "grpo_r2": {"rl.loss.name": "grpo", "rl.loss.clip_low": 0.2, "rl.loss.clip_high": 0.27, "rl.routing_replay": "r2"},
        "grpo_r3": {"rl.loss.name": "grpo", "rl.loss.clip_low": 0.2, "rl.loss.clip_high": 0.27, "rl.routing_replay": "r3"}}
SETTINGS = {"on_policy": {"rl.batch.mini_batches": 1}, "off_policy_4x": {"rl.batch.mini_batches": 4}}


def _write_recipe(tmp_path, **changes):
    raw = {"name": "t", "base": os.path.join(REPO, "configs", "tiny_cpu.yaml"), "seeds": [0, 1],
           "cold_start": "sft", "common": {"rl.steps": 10}, "arms": ARMS, "settings": SETTINGS}
    raw.update(changes)
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


# ------------------------------------------------------------------------------------- arms x settings
def test_cells_are_the_product_of_arms_and_settings(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path), out_dir=str(tmp_path / "out"))
    assert spec.cells() == [f"{s}/{a}" for s in SETTINGS for a in ARMS]
    runs = plan_runs(spec, [])
    assert [(r.kind, r.seed) for r in runs[:2]] == [("cold_start", 0), ("cold_start", 1)]
    assert [(r.arm, r.seed) for r in runs[2:]] == [(c, s) for s in (0, 1) for c in spec.cells()]
    dirs = {r.run_dir for r in runs}
    assert len(dirs) == len(runs)  # every (cell, seed) has its own folder
    configs = spec.validate_runs([])
    assert set(configs) == set(spec.cells())
    for setting, s_over in SETTINGS.items():
        for arm, a_over in ARMS.items():
            cell = f"{setting}/{arm}"
            assert spec.split_cell(cell) == (arm, setting)
            assert spec.cell_dir(cell, 1) == os.path.join(str(tmp_path / "out"), setting, arm, "seed1")
            cfg = flatten_keys(spec.cell_config(cell, 1, ["rl.steps=7"]).to_dict())
            for key, value in {**a_over, **s_over}.items():
                assert cfg[key] == value, (cell, key)
            assert cfg["rl.steps"] == 7 and cfg["seed"] == 1 and cfg["sft.steps"] == 0
            # every cell of a seed starts from that seed's one cold start
            assert cfg["model.init_from"] == os.path.join(spec.cold_start_dir(1), "checkpoint.pt")
            assert cfg["log.out_dir"] == os.path.join(str(tmp_path / "out"), setting, arm)
    # two cells differ only in what their arms and settings name (and where they write)
    flat = {c: flatten_keys(cfg.to_dict()) for c, cfg in configs.items()}
    for a in flat:
        for b in flat:
            differ = {k for k in flat[a] if flat[a][k] != flat[b][k]}
            named = set().union(*(ARMS[spec.split_cell(c)[0]] for c in (a, b)),
                                *(SETTINGS[spec.split_cell(c)[1]] for c in (a, b)))
            assert differ <= named | {"log.out_dir", "rollout.record_routes"}, (a, b, differ - named)


def test_without_settings_the_cells_are_the_arms_in_their_old_folders(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path, settings=None), out_dir=str(tmp_path / "out"))
    assert spec.cells() == list(ARMS)
    assert spec.cell_dir("grpo", 0) == os.path.join(str(tmp_path / "out"), "grpo", "seed0")
    with pytest.raises(ConfigError, match="is not a cell"):
        spec.split_cell("on_policy/grpo")


@pytest.mark.parametrize("changes, message", [
    ({"settings": {"off": {"rl.loss.name": "grpo"}}}, "arm 'gspo' and setting 'off' both set 'rl.loss.name'"),
    ({"settings": {"grpo": {"rl.batch.mini_batches": 2}}}, "has the name of an arm"),
    ({"settings": {"Off": {"rl.batch.mini_batches": 2}}}, "setting name 'Off'"),
    ({"settings": {"off": {"model.num_experts": 8}}}, "settings.off: 'model.num_experts' would change the model"),
    ({"settings": {"off": {"seed": 2}}}, "'seed' is set by the harness"),
    ({"settings": {"off": 4}}, "setting 'off' must map keys to values"),
])
def test_bad_settings_name_the_problem(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_ablation(_write_recipe(tmp_path, **changes))


def test_settings_subset_and_a_bad_key_names_the_cell(tmp_path):
    path = _write_recipe(tmp_path)
    spec = load_ablation(path, settings=["off_policy_4x"], arms=["grpo", "grpo_r3"])
    assert spec.cells() == ["off_policy_4x/grpo", "off_policy_4x/grpo_r3"]
    with pytest.raises(ConfigError, match="--settings 'twice' is not a setting"):
        load_ablation(path, settings=["twice"])
    spec = load_ablation(_write_recipe(tmp_path, settings={"odd": {"rl.mini_batch": 3}}))
    with pytest.raises(ConfigError, match=r"cell 'odd/gspo': unknown config key 'rl.mini_batch'"):
        spec.validate_runs([])


def test_the_v1_testbed_is_5_arms_x_2_settings_x_3_seeds_with_its_own_cold_start():
    spec = load_ablation(os.path.join(REPO, "configs", "ablations", "moe_volatile_cpu.yaml"))
    assert set(spec.arms) == set(ARMS) and len(spec.settings) == 2 and len(spec.seeds) == 3
    configs = spec.validate_runs([])
    roles = {(ArmResult(c, cfg.to_dict()).role, cfg.rl.batch.mini_batches) for c, cfg in configs.items()}
    assert roles == {(r, m) for r in ARMS for m in (1, 4)}
    runs = plan_runs(spec, [])
    assert [r.kind for r in runs].count("cold_start") == 3 and len(runs) == 3 + 30
    for cfg in configs.values():  # the replaying arms get the engine's routes exactly when R3 reads them
        assert cfg.rollout.record_routes == (cfg.rl.routing_replay == "r3")
    cold = spec.cold_start_config(0, [])
    assert cold.sft.steps > 0 and cold.model.num_experts > 4  # its own cold start, not the main job's model


def test_cluster_recipe_prints_one_command_per_cell_and_seed():
    recipe = os.path.join(REPO, "configs", "ablations", "qwen3_30b_a3b.yaml")
    proc = subprocess.run([sys.executable, "-m", "megagspo.cli", "ablate", "--config", recipe, "--print-commands"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("megagspo train")]
    spec = load_ablation(recipe)
    assert len(lines) == len(spec.cells()) * len(spec.seeds) == 20
    for cell in spec.cells():
        arm, setting = spec.split_cell(cell)
        mine = [line for line in lines if f"log.out_dir={spec.out_dir}/{setting}/{arm} " in line]
        assert len(mine) == 2, cell
        for key, value in {**spec.arms[arm], **spec.settings[setting]}.items():
            assert all(f"{key}={value:g}" in line if isinstance(value, float) else f"{key}={value}" in line
                       for line in mine), (cell, key)


# ------------------------------------------------------------------------------------ the claim rules
def _arm(name, role, per_seed_acc, mini_batches=4, setting="s", reward=None, tok_clip=0.01):
    loss, _, replay = role.partition("_")
    config = {"rl": {"loss": {"name": loss, "clip_low": 0.2, "clip_high": 0.27}, "routing_replay": replay or "none",
                     "batch": {"mini_batches": mini_batches}}}
    cells = []
    for seed, acc in per_seed_acc.items():
        r = acc if reward is None else reward
        rows = [{"reward/mean": r, "clip/tok_frac": tok_clip, "clip/seq_frac": tok_clip, "moe/expert_volatility": 0.1,
                 "kl/approx_old": 0.0, "time/step_s": 1.0}] * 5
        cells.append(CellResult(name, seed, config, {"final/accuracy": acc}, rows, 0.5))
    return ArmResult(f"{setting}/{name}" if setting else name, config, cells, arm=name, setting=setting)


def _accs(base, noise=(0.0, 0.004, -0.003)):
    return {s: base + n for s, n in enumerate(noise)}


def _verdicts(arms):
    return {c: v for c, v, _ in claims({a.name: a for a in arms})}


def test_two_se_band_against_hand_computed_values():
    # d = [0.1, 0.2, 0.3]: mean 0.2, sd 0.1, 2 SE = 0.2 / sqrt(3) = 0.1155 -> beyond noise
    c = compare_values({0: 0.1, 1: 0.2, 2: 0.3}, {0: 0.0, 1: 0.0, 2: 0.0}, "a", "b", "final_acc")
    assert c.paired and c.diff == pytest.approx(0.2) and c.two_se == pytest.approx(0.2 / math.sqrt(3))
    assert c.significant is True
    # d = [0.1, -0.1, 0.3]: mean 0.1, sd 0.2, 2 SE = 0.2309 -> within noise
    c = compare_values({0: 0.1, 1: -0.1, 2: 0.3}, {0: 0.0, 1: 0.0, 2: 0.0}, "a", "b", "final_acc")
    assert c.two_se == pytest.approx(0.4 / math.sqrt(3)) and c.significant is False
    # different seeds: unpaired, 2 * sqrt(s_a^2/n_a + s_b^2/n_b)
    c = compare_values({0: 1.0, 1: 3.0}, {2: 0.0, 3: 0.0, 4: 0.0}, "a", "b", "final_acc")
    assert not c.paired and c.diff == pytest.approx(2.0) and c.two_se == pytest.approx(2 * math.sqrt(2.0 / 2))
    # one seed: no spread
    assert compare_values({0: 1.0}, {0: 0.0}, "a", "b", "final_acc").significant is None


def test_above_and_no_benefit_rules():
    up = compare_values(_accs(0.7), _accs(0.5), "hi", "lo", "final_acc")
    down = compare_values(_accs(0.4), _accs(0.5), "hi", "lo", "final_acc")
    noise = compare_values({0: 0.5, 1: 0.52, 2: 0.49}, {0: 0.5, 1: 0.49, 2: 0.51}, "hi", "lo", "final_acc")
    assert above_verdict([up, up]).startswith("HELD")
    assert above_verdict([up, noise]).startswith("PARTLY: 1 of 2")
    assert above_verdict([up, down]).startswith("DID NOT HOLD: lo above hi")
    assert above_verdict([noise, noise]).startswith("not resolved")
    assert no_benefit_verdict([noise]).startswith("HELD: no replay arm")
    assert no_benefit_verdict([down]).startswith("HELD") and "below" in no_benefit_verdict([down])
    assert no_benefit_verdict([up]).startswith("DID NOT HOLD: hi is above lo")
    same = compare_values(_accs(0.5), _accs(0.5), "hi", "lo", "final_acc")
    assert no_benefit_verdict([same]).startswith("HELD: the replay arms end exactly")


def test_r3_ordering_held_reversed_partly():
    order = {"grpo": 0.49, "gspo": 0.67, "grpo_r3": 0.68, "gspo_r3": 0.69}  # the R3 paper's scores / 100
    key = "R3 paper: final accuracy GRPO < GSPO < GRPO + R3 < GSPO + R3 [s: 4 updates per rollout batch]"
    held = _verdicts([_arm(r, r, _accs(v)) for r, v in order.items()])
    assert held[key].startswith("HELD: all 3 pairs")
    swapped = dict(order, gspo_r3=0.60)  # GSPO + R3 below GRPO + R3 (and below GSPO) on every seed
    assert _verdicts([_arm(r, r, _accs(v)) for r, v in swapped.items()])[key].startswith(
        "DID NOT HOLD: s/grpo_r3 above s/gspo_r3")
    flat = dict(order, grpo_r3=0.67, gspo_r3=0.67)  # only GRPO < GSPO resolves
    assert _verdicts([_arm(r, r, _accs(v)) for r, v in flat.items()])[key].startswith("PARTLY: 1 of 3")
    assert not any(k.startswith("R3 paper") for k in _verdicts([_arm(r, r, _accs(v)) for r, v in order.items()
                                                               if r != "gspo_r3"]))  # needs all four


def test_qwen_on_vs_off_policy_claims():
    on = {"grpo": 0.60, "grpo_r2": 0.60, "grpo_r3": 0.60}        # on-policy: replay changes nothing
    off = {"grpo": 0.40, "grpo_r2": 0.55, "grpo_r3": 0.65}       # 4x off-policy: R3 > R2 > none
    arms = [_arm(r, r, _accs(v), 1, "on") for r, v in on.items()] + \
           [_arm(r, r, _accs(v), 4, "off") for r, v in off.items()]
    v = _verdicts(arms)
    assert v["Qwen team: on-policy (1 update per batch) GRPO needs no routing replay [on]"].startswith(
        "HELD: the replay arms end exactly")
    assert v["Qwen team: at 4 updates per batch GRPO + R3 is the best GRPO arm [off]"].startswith("HELD")
    assert v["Qwen team: routing replay helps GRPO more off-policy (off) than on-policy (on)"].startswith("HELD")
    # the opposite world: on-policy replay helps, off-policy R2 beats R3
    on2 = {"grpo": 0.50, "grpo_r2": 0.60, "grpo_r3": 0.60}
    off2 = {"grpo": 0.50, "grpo_r2": 0.65, "grpo_r3": 0.55}
    arms = [_arm(r, r, _accs(v), 1, "on") for r, v in on2.items()] + \
           [_arm(r, r, _accs(v), 4, "off") for r, v in off2.items()]
    v = _verdicts(arms)
    assert v["Qwen team: on-policy (1 update per batch) GRPO needs no routing replay [on]"].startswith(
        "DID NOT HOLD: on/grpo_r2 is above on/grpo")
    assert v["Qwen team: at 4 updates per batch GRPO + R3 is the best GRPO arm [off]"].startswith(
        "DID NOT HOLD: off/grpo_r2 above off/grpo_r3")
    # R2's gain is 0.15 off-policy vs 0.10 on-policy (beyond noise), R3's 0.05 vs 0.10 (against): DID NOT HOLD
    assert v["Qwen team: routing replay helps GRPO more off-policy (off) than on-policy (on)"].startswith(
        "DID NOT HOLD")


def test_gspo_paper_claims_per_setting_and_one_seed_is_indicative():
    arms = []
    for setting, mb in (("on", 1), ("off", 4)):
        arms += [_arm("gspo", "gspo", _accs(0.7), mb, setting, tok_clip=0.2),
                 _arm("grpo_r2", "grpo_r2", _accs(0.6), mb, setting, tok_clip=0.002),
                 _arm("grpo", "grpo", _accs(0.5), mb, setting, tok_clip=0.002)]
    v = _verdicts(arms)
    for setting, words in (("on", "1 update per"), ("off", "4 updates per")):
        tag = f" [{setting}: {words} rollout batch]"
        assert v["Figure 1: GSPO trains more efficiently than GRPO" + tag].startswith("HELD")
        assert v["Figure 2: GSPO clips far more tokens than GRPO yet learns better" + tag].startswith(
            "HELD: GSPO clips 100x")
        assert v["Figure 3: GRPO on MoE needs routing replay to converge" + tag].startswith("HELD")
    single = _verdicts([_arm("gspo", "gspo", {0: 0.7}, setting=""), _arm("grpo", "grpo", {0: 0.5}, setting="")])
    assert single["Figure 1: GSPO trains more efficiently than GRPO"].startswith("indicative only (one seed)")


# ------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_short_arms_x_settings_ablation_end_to_end(tmp_path):
    """2 arms x 2 settings x 1 seed of the default testbed, a few steps: each cell runs in its own folder with
    its setting's updates per batch, the report holds every cell, the per-setting and per-arm plots and the
    on- vs off-policy claims; a rerun finds all done."""
    from helpers import CliRuns
    from multiprocess import cpu_pinned_env

    recipe = os.path.join(REPO, "configs", "ablations", "moe_volatile_cpu.yaml")
    short = ["sft.steps=4", "sft.batch_size=16", "rl.steps=2", "rl.batch.prompts_per_step=4", "rl.batch.group_size=4",
             "rl.eval.every=2", "data.train_size=200", "data.eval_size=20", "checkpoint.every_steps=0"]
    out = str(tmp_path / "abl")
    args = ["--config", recipe, "--out", out, "--seeds", "0", "--arms", "grpo,grpo_r3", "--jobs", "2", *short]
    env = cpu_pinned_env(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cli = CliRuns(env, str(tmp_path / "cli.log"))  # both `megagspo ablate` commands in one process
    try:
        _short_arms_x_settings_ablation(recipe, out, lambda: cli.run(["ablate", *args], timeout=600))
    finally:
        cli.close()


def _short_arms_x_settings_ablation(recipe, out, ablate):
    import json

    proc = ablate()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spec = load_ablation(recipe, out_dir=out, seeds=[0], arms=["grpo", "grpo_r3"])
    text = open(os.path.join(out, "report.md")).read()
    for cell in spec.cells():
        arm, setting = spec.split_cell(cell)
        assert f"| {cell} |" in text
        with open(os.path.join(spec.cell_dir(cell, 0), "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        assert cfg["rl"]["batch"]["mini_batches"] == spec.settings[setting]["rl.batch.mini_batches"]
        assert cfg["rl"]["routing_replay"] == spec.arms[arm]["rl.routing_replay"]
        rows = [json.loads(line) for line in open(os.path.join(spec.cell_dir(cell, 0), "metrics.jsonl"))]
        assert len([r for r in rows if r["phase"] == "rl"]) == 2
    for setting in spec.settings:
        assert os.path.getsize(os.path.join(out, f"ablation_reward_accuracy_{setting}.png")) > 1000
    assert os.path.getsize(os.path.join(out, "ablation_per_arm.png")) > 1000
    assert "## Expert volatility reached" in text and "Qwen team: on-policy" in text
    report = json.load(open(os.path.join(out, "report.json")))
    assert set(spec.cells()) <= set(report) and report["_claims"]
    again = ablate()
    assert again.returncode == 0 and again.stdout.count(": already done (") == 1 + 4, again.stdout


def test_clipping_claim_is_not_testable_on_policy_but_judged_off_policy():
    """At 1 update per batch every ratio is 1: no arm can clip, and Figure 2 says so instead of 'did not hold';
    the same zero clipping at 4 updates per batch is judged."""
    for mb, start in ((1, "NOT TESTABLE"), (4, "DID NOT HOLD: GSPO clipped no token")):
        v = _verdicts([_arm("gspo", "gspo", _accs(0.7), mb, "x", tok_clip=0.0),
                       _arm("grpo_r2", "grpo_r2", _accs(0.6), mb, "x", tok_clip=0.0)])
        key = next(k for k in v if k.startswith("Figure 2"))
        assert v[key].startswith(start), (mb, v[key])
