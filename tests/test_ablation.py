"""`megagspo ablate`: the recipe is validated before any compute, arms differ only in what they name, the
report aggregates seeds correctly and judges the paper's claims by the stated rule, and a short end-to-end
ablation (3 arms, 1 seed, a few steps) writes a report holding every arm."""

import json
import math
import os
import random

import pytest
import yaml

from megagspo.ablation import load_ablation, plan_runs, write_report
from megagspo.ablation.report import claims, load_results, mean_std, smooth
from megagspo.config import flatten_keys
from megagspo.ablation.runner import run_state
from megagspo.config import ConfigError
from helpers import CliRuns
from multiprocess import cpu_pinned_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "ablations", "tiny_cpu.yaml")
ARMS = {"gspo": {"rl.loss.name": "gspo", "rl.loss.clip_low": 0.003, "rl.loss.clip_high": 0.004},
        "grpo_r2": {"rl.loss.name": "grpo", "rl.loss.clip_low": 0.2, "rl.loss.clip_high": 0.27, "rl.routing_replay": "r2"},
        "grpo": {"rl.loss.name": "grpo", "rl.loss.clip_low": 0.2, "rl.loss.clip_high": 0.27, "rl.routing_replay": "none"}}


def _write_recipe(tmp_path, **changes):
    raw = {"name": "t", "base": os.path.join(REPO, "configs", "tiny_cpu.yaml"), "seeds": [0, 1],
           "cold_start": "sft", "common": {"rl.steps": 10}, "arms": ARMS}
    raw.update(changes)
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


# ------------------------------------------------------------------------------------------ recipe checks
@pytest.mark.parametrize("changes, message", [
    ({"armz": {}}, "unknown ablation key 'armz'"),
    ({"arms": {"a": {"model.hidden_size": 64}}}, "'model.hidden_size' would change the model"),
    ({"arms": {"a": {"data.train_size": 10}}}, "would change the model, data or cold start"),
    ({"arms": {"a": {"seed": 3}}}, "'seed' is set by the harness"),
    ({"common": {"model.init_from": "x"}}, "'model.init_from' is set by the harness"),
    ({"arms": {"Bad-Name": {}}}, "arm name 'Bad-Name'"),
    ({"arms": {}}, "at least one arm"),
    ({"seeds": [0, 0]}, "repeat a seed"),
    ({"seeds": [-1]}, "non-negative integers"),
    ({"cold_start": "maybe"}, "valid: sft, recipe"),
    ({"base": "nope.yaml"}, "does not exist"),
])
def test_bad_recipes_name_the_problem(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_ablation(_write_recipe(tmp_path, **changes))


def test_unknown_training_key_in_an_arm_names_the_arm_and_the_valid_keys(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path, arms={"a": {"rl.clip_lo": 0.1}}))
    with pytest.raises(ConfigError, match=r"arm 'a': unknown config key 'rl.clip_lo'.*clip_low"):
        spec.validate_runs([])


def test_cold_start_mode_must_match_the_recipe(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path, cold_start="recipe"))
    with pytest.raises(ConfigError, match="sft.steps = 400"):
        spec.validate_runs([])
    spec = load_ablation(_write_recipe(tmp_path))
    with pytest.raises(ConfigError, match="sft.steps = 0"):
        spec.validate_runs(["sft.steps=0"])


def test_subsets_are_checked(tmp_path):
    path = _write_recipe(tmp_path)
    with pytest.raises(ConfigError, match="--arms 'ppo' is not an arm"):
        load_ablation(path, arms=["ppo"])
    with pytest.raises(ConfigError, match=r"--seeds \[5\]"):
        load_ablation(path, seeds=[5])
    spec = load_ablation(path, arms=["grpo"], seeds=[1])
    assert list(spec.arms) == ["grpo"] and spec.seeds == [1]




def test_arms_differ_only_in_what_they_name(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path), out_dir=str(tmp_path / "out"))
    runs = plan_runs(spec, ["rl.steps=7"])
    kinds = [(r.kind, r.seed) for r in runs]
    assert kinds[:2] == [("cold_start", 0), ("cold_start", 1)]  # cold starts first, then cells seed-major
    assert [(r.arm, r.seed) for r in runs[2:]] == [(a, s) for s in (0, 1) for a in ARMS]
    for seed in (0, 1):
        cfgs = {arm: flatten_keys(spec.cell_config(arm, seed, ["rl.steps=7"]).to_dict()) for arm in ARMS}
        for a in ARMS:
            for b in ARMS:
                differ = {k for k in cfgs[a] if cfgs[a][k] != cfgs[b][k]}
                allowed = set(ARMS[a]) | set(ARMS[b]) | {"rl.routing_replay", "log.out_dir"}
                assert differ <= allowed, f"{a} vs {b} differ in {differ - allowed}"
        for cfg in cfgs.values():
            assert cfg["seed"] == seed and cfg["rl.steps"] == 7 and cfg["sft.steps"] == 0
            assert cfg["model.init_from"] == os.path.join(spec.cold_start_dir(seed), "checkpoint.pt")
            assert cfg["checkpoint.resume"] == "auto"
    cold = flatten_keys(spec.cold_start_config(0, ["rl.steps=7"]).to_dict())
    assert cold["rl.steps"] == 0 and cold["sft.steps"] == 400 and cold["seed"] == 0
    for run in runs:  # what `ablate --print-commands` prints names each key once (the last value won anyway)
        keys = [o.split("=", 1)[0] for o in run.overrides]
        assert len(keys) == len(set(keys)), run.overrides
    assert [o for o in runs[0].overrides if o.startswith("rl.steps=")] == ["rl.steps=0"]


def test_a_folder_with_another_config_is_refused_not_overwritten(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path), out_dir=str(tmp_path / "out"))
    run = plan_runs(spec, [])[2]
    assert run_state(spec, run, []) == "new"
    os.makedirs(run.run_dir)
    cfg = spec.cell_config(run.arm, run.seed, []).to_dict()
    with open(os.path.join(run.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    assert run_state(spec, run, []) == "partial"
    open(os.path.join(run.run_dir, "summary.json"), "w").write("{}")
    assert run_state(spec, run, []) == "done"
    with pytest.raises(ConfigError, match=r"different config \(rl.steps: 10 there, 11 asked"):
        run_state(spec, run, ["rl.steps=11"])


# ------------------------------------------------------------------------------------------------- report
def _fake_cell(spec, arm, seed, acc_final, reward, tok_clip, steps=20, cold=0.5, vol=0.01):
    run_dir = spec.cell_dir(arm, seed)
    os.makedirs(run_dir)
    cfg = spec.cell_config(arm, seed, []).to_dict()
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    rows = [{"phase": "cold_start", "step": 0, "eval/accuracy": cold}]
    for s in range(steps):
        rows.append({"phase": "rl", "step": s, "reward/mean": reward, "clip/tok_frac": tok_clip,
                     "clip/seq_frac": tok_clip, "moe/expert_volatility": vol, "kl/approx_old": 1e-4,
                     "time/step_s": 0.3, "eval/accuracy": acc_final if s == steps - 1 else cold,
                     "eval/fresh": 1.0 if s in (9, steps - 1) else 0.0})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"cold_start/accuracy": cold, "final/accuracy": acc_final, "final/sampled_accuracy": acc_final / 2,
                   "rl/time_s": 6.0}, f)


def test_report_aggregates_seeds_and_judges_claims(tmp_path):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    spec = load_ablation(_write_recipe(tmp_path, seeds=[0, 1, 2]), out_dir=str(tmp_path / "out"))
    accs = {"gspo": [0.8 + rng.uniform(-0.01, 0.01) for _ in range(3)],      # clearly above the others
            "grpo_r2": [0.6 + rng.uniform(-0.01, 0.01) for _ in range(3)],
            "grpo": [0.6 + rng.uniform(-0.2, 0.2) for _ in range(3)]}        # noisy: within 2 SE of grpo_r2?
    for arm, values in accs.items():
        for s, a in enumerate(values):
            _fake_cell(spec, arm, s, a, reward=a, tok_clip=0.2 if arm == "gspo" else 0.002)
    arms, missing = load_results(spec)
    assert not missing and set(arms) == set(ARMS)
    from megagspo.ablation.report import arm_table

    mean, std = arm_table(arms["gspo"])["final_acc"]
    ref_mean = sum(accs["gspo"]) / 3
    ref_std = math.sqrt(sum((a - ref_mean) ** 2 for a in accs["gspo"]) / 2)
    assert mean == pytest.approx(ref_mean, rel=1e-12) and std == pytest.approx(ref_std, rel=1e-9)
    verdicts = {c: v for c, v, _ in claims(arms)}
    assert verdicts["Figure 1: GSPO trains more efficiently than GRPO"].startswith("HELD")
    fig2 = verdicts["Figure 2: GSPO clips far more tokens than GRPO yet learns better"]
    assert fig2.startswith("HELD: GSPO clips 100x") and "does not" not in fig2
    # Figure 3 by the paired 2-SE rule (same seeds in both arms), computed independently here
    diffs = [x - y for x, y in zip(accs["grpo_r2"], accs["grpo"])]
    d = sum(diffs) / 3
    se2 = 2 * math.sqrt(sum((x - d) ** 2 for x in diffs) / 2) / math.sqrt(3)
    fig3 = verdicts["Figure 3: GRPO on MoE needs routing replay to converge"]
    if abs(d) <= se2:
        assert fig3.startswith("not resolved")
    else:
        assert fig3.startswith("HELD" if d > 0 else "DID NOT HOLD")
    path = write_report(spec, command="megagspo ablate --config x")
    text = open(path).read()
    for arm in ARMS:
        assert f"| {arm} |" in text
    for png in ("ablation_reward_accuracy.png", "ablation_clip_fraction.png", "ablation_expert_volatility.png",
                "ablation_routing_replay.png"):
        assert f"]({png})" in text and os.path.getsize(os.path.join(spec.out_dir, png)) > 1000
    assert f"{ref_mean:.3f} ± {ref_std:.3f}" in text


def test_paired_comparison_sees_a_consistent_effect_that_cold_start_spread_hides(tmp_path):
    """Seeds with very different cold starts, one arm always +0.02 over the other: unpaired, the spread between
    seeds (~0.2) hides it; paired over seeds it is beyond noise."""
    spec = load_ablation(_write_recipe(tmp_path, seeds=[0, 1, 2]), out_dir=str(tmp_path / "out"))
    for s, base in enumerate((0.4, 0.6, 0.8)):
        _fake_cell(spec, "gspo", s, base + 0.02 + 0.001 * s, reward=base, tok_clip=0.2, cold=base)
        _fake_cell(spec, "grpo_r2", s, base, reward=base, tok_clip=0.001, cold=base)
    from megagspo.ablation.report import compare

    arms = load_results(spec)[0]
    cmp = compare(arms["gspo"], arms["grpo_r2"], "final_acc")
    assert cmp.paired and cmp.significant and cmp.diff == pytest.approx(0.021)
    verdicts = {c: v for c, v, _ in claims(arms)}
    # the training reward is equal by construction: accuracy alone favours GSPO -> PARTLY
    assert verdicts["Figure 1: GSPO trains more efficiently than GRPO"].startswith("PARTLY: GSPO is higher in final")


def test_reversed_claim_and_missing_cells_are_reported(tmp_path):
    spec = load_ablation(_write_recipe(tmp_path, seeds=[0, 1]), out_dir=str(tmp_path / "out"))
    for s in (0, 1):
        _fake_cell(spec, "gspo", s, 0.4 + 0.01 * s, reward=0.4, tok_clip=0.01)
        _fake_cell(spec, "grpo_r2", s, 0.7 + 0.01 * s, reward=0.7, tok_clip=0.01)
    _fake_cell(spec, "grpo", 0, 0.7, reward=0.7, tok_clip=0.01)
    verdicts = {c: v for c, v, _ in claims(load_results(spec)[0])}
    assert verdicts["Figure 1: GSPO trains more efficiently than GRPO"].startswith("DID NOT HOLD")
    assert verdicts["Figure 2: GSPO clips far more tokens than GRPO yet learns better"].startswith("DID NOT HOLD")
    text = open(write_report(spec)).read()
    assert "Missing or unfinished runs" in text and os.path.join("grpo", "seed1") in text
    assert "| grpo | `rl.loss.name=grpo`" in text and "1 of 2" in text


def test_smooth_and_mean_std_against_hand_values():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    m, s = mean_std([1.0, 2.0, 3.0])
    assert m == 2.0 and s == 1.0
    assert math.isnan(mean_std([4.0])[1])


# ------------------------------------------------------------------------------------------- end to end
SHORT = ["sft.steps=4", "sft.batch_size=16", "rl.steps=3", "rl.batch.prompts_per_step=4", "rl.batch.group_size=4",
         "rl.batch.mini_batches=2", "rl.eval.every=2", "data.train_size=200", "data.eval_size=20"]


@pytest.mark.slow
def test_short_ablation_end_to_end(tmp_path):
    env = cpu_pinned_env(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))  # CPU runs, any host
    cli = CliRuns(env, str(tmp_path / "cli.log"))  # the three `megagspo ablate` commands in one process

    def _ablate(args, timeout=300):
        return cli.run(["ablate", *args], timeout=timeout)

    try:
        _short_ablation_end_to_end(tmp_path, _ablate)
    finally:
        cli.close()


def _short_ablation_end_to_end(tmp_path, _ablate):
    out = str(tmp_path / "abl")
    proc = _ablate(["--config", RECIPE, "--out", out, "--seeds", "0", "--jobs", "2", *SHORT])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = open(os.path.join(out, "report.md")).read()
    spec = load_ablation(RECIPE, out_dir=out, seeds=[0])
    for arm in spec.arms:
        assert f"| {arm} |" in text, f"arm {arm} missing from the report"
        rows = [json.loads(line) for line in open(os.path.join(spec.cell_dir(arm, 0), "metrics.jsonl"))]
        assert len([r for r in rows if r["phase"] == "rl"]) == 3
    for png in ("ablation_reward_accuracy.png", "ablation_clip_fraction.png", "ablation_expert_volatility.png",
                "ablation_routing_replay.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000
    assert "Figure 1" in text and "Figure 2" in text and "Figure 3" in text
    # Same cold start, seed and data order: every arm's first rollout (before any update) is the same.
    first = {}
    for arm in spec.arms:
        rows = [json.loads(line) for line in open(os.path.join(spec.cell_dir(arm, 0), "metrics.jsonl"))]
        rl0 = next(r for r in rows if r["phase"] == "rl")
        first[arm] = (rl0["reward/mean"], rl0["response/length_mean"])
    assert len(set(first.values())) == 1, first
    # A rerun finds everything done and only rewrites the report; another config is refused.
    again = _ablate(["--config", RECIPE, "--out", out, "--seeds", "0", *SHORT])
    assert again.returncode == 0 and again.stdout.count(": already done (") == 4, again.stdout
    other = _ablate(["--config", RECIPE, "--out", out, "--seeds", "0", *SHORT[:-1], "data.eval_size=10"])
    assert other.returncode == 2 and "different config (data.eval_size: 20 there, 10 asked" in other.stderr


def test_cluster_ablation_cells_each_pass_the_dry_run():
    """Every cell (arm x setting) of the Qwen3-30B-A3B ablation is a valid 8-GPU recipe (config, layout, memory
    plan); R3 cells ask the SGLang servers for routes."""
    from megagspo.dry_run import dry_run

    spec = load_ablation(os.path.join(REPO, "configs", "ablations", "qwen3_30b_a3b.yaml"))
    configs = spec.validate_runs([])
    assert set(spec.arms) == {"gspo", "gspo_r3", "grpo", "grpo_r2", "grpo_r3"} and spec.cold_start == "recipe"
    assert set(configs) == set(spec.cells()) and len(configs) == 10
    assert [r.kind for r in plan_runs(spec, [])] == ["cell"] * 20  # no SFT: the recipe's init_from is shared
    for cell in spec.cells():
        missing = []
        cfg = spec.cell_config(cell, 0, [], missing)
        report = dry_run(cfg, missing_paths=missing)
        assert report.world_size == 8, cell
        assert cfg.rollout.record_routes == (cfg.rl.routing_replay == "r3"), cell
    assert configs["off_policy_4x/gspo"].rl.loss.clip_low == 3e-4 and configs["on_policy/grpo_r2"].rl.routing_replay == "r2"
    assert {c.rl.batch.mini_batches for c in configs.values()} == {1, 4}
