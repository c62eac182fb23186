"""The ablation v2 (issue 47): its recipe (5 arms x 4 settings x 3 seeds, an fp8_sim stress engine and an fp32
control), the rules fixed in megagspo.ablation.claims before its run (the R3 paper's mechanism, Qwen's v2 claims,
the edge of a band) on synthetic cell results whose answer is known, the machine record and the report's mismatch
section. No training: fast."""

from __future__ import annotations

import json
import math
import os

import pytest
import yaml

from megagspo.ablation import load_ablation, plan_runs, write_report
from megagspo.ablation.claims import EDGE_MARK, claims, compare_values, edge_claims
from megagspo.ablation.machine import cpu_info, machine_lines, record_machine
from megagspo.ablation.results import ArmResult, CellResult, arm_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V2 = os.path.join(REPO, "configs", "ablations", "moe_mismatch_cpu.yaml")
ROLES = ("gspo", "gspo_r3", "grpo", "grpo_r2", "grpo_r3")


# ------------------------------------------------------------------------------------------------ the recipe
def test_v2_recipe_is_5_arms_x_4_settings_x_3_seeds_with_a_stress_engine_and_an_fp32_control():
    spec = load_ablation(V2)
    assert len(spec.arms) == 5 and len(spec.seeds) == 3
    configs = spec.validate_runs([])
    cells = {(ArmResult(c, cfg.to_dict()).role, cfg.rl.batch.mini_batches, cfg.rollout.engine_dtype)
             for c, cfg in configs.items()}
    assert cells == {(r, m, e) for r in ROLES for m, e in ((1, "fp32"), (1, "fp8_sim"), (2, "fp8_sim"),
                                                            (4, "fp8_sim"))}
    runs = plan_runs(spec, [])
    assert [r.kind for r in runs].count("cold_start") == 3 and len(runs) == 3 + 60
    cold = spec.cold_start_config(0, [])
    assert cold.sft.steps == 400 and cold.model.num_experts == 32
    for cfg in configs.values():  # the RL aux-loss coefficient is RL's own, recorded in every run's config
        assert cfg.rl.router_aux_loss_coef is not None and cfg.rl.route_gap
    # the Makefile's `make ablate` runs this recipe
    with open(os.path.join(REPO, "Makefile")) as f:
        assert "ABLATION ?= configs/ablations/moe_mismatch_cpu.yaml" in f.read()


def test_the_screen_recipe_holds_the_rules_fixed_setting():
    spec = load_ablation(os.path.join(REPO, "configs", "ablations", "testbed_v2_screen.yaml"))
    for cell, cfg in spec.validate_runs([]).items():
        assert (cfg.rl.loss.name, cfg.rl.routing_replay, cfg.rl.batch.mini_batches, cfg.rollout.engine_dtype,
                cfg.rl.steps) == ("gspo", "none", 4, "fp8_sim", 100), cell


# ------------------------------------------------------------------------------------- synthetic cell results
def _arm(role, acc, setting="s", mini_batches=4, engine="fp8_sim", k3=None, f2=None, reward=None):
    """One cell over seeds 0..n-1: acc / k3 / f2 / reward are per-seed lists (rows repeat the value)."""
    loss, _, replay = role.partition("_")
    config = {"rl": {"loss": {"name": loss, "clip_low": 0.2, "clip_high": 0.27}, "routing_replay": replay or "none",
                     "batch": {"mini_batches": mini_batches}}, "rollout": {"engine_dtype": engine}}
    cells = []
    for seed, a in enumerate(acc):
        row = {"reward/mean": a if reward is None else reward[seed], "clip/tok_frac": 0.01, "clip/seq_frac": 0.01,
               "moe/expert_volatility": 0.05, "kl/approx_old": 0.0, "time/step_s": 1.0}
        if k3 is not None:
            row.update({"mismatch/k3_kl": k3[seed], "mismatch/frac_over_ln2": f2[seed],
                        "mismatch/route_pair_frac": 0.1})
        cells.append(CellResult(role, seed, config, {"final/accuracy": a}, [row] * 4, 0.5))
    return ArmResult(f"{setting}/{role}", config, cells, arm=role, setting=setting)


def _verdicts(arms):
    return {c: (v, e) for c, v, e in claims({a.name: a for a in arms})}


def _key(verdicts, start):
    hits = [k for k in verdicts if k.startswith(start)]
    assert len(hits) == 1, (start, list(verdicts))
    return verdicts[hits[0]][0]


ACC = [0.7, 0.72, 0.68]
HIGH, LOW = [2.0e-3, 2.2e-3, 1.9e-3], [1.0e-3, 1.05e-3, 0.97e-3]


def test_r3_mechanism_held_reversed_partly_and_f2_at_zero_left_out():
    mech = "R3 paper (mechanism): GRPO + R3"
    held = _verdicts([_arm("grpo", ACC, k3=HIGH, f2=HIGH), _arm("grpo_r3", ACC, k3=LOW, f2=LOW)])
    assert _key(held, mech).startswith("HELD: k3 KL and F(tau=2) lower with R3")
    worse = _verdicts([_arm("grpo", ACC, k3=LOW, f2=LOW), _arm("grpo_r3", ACC, k3=HIGH, f2=LOW)])
    assert _key(worse, mech).startswith("DID NOT HOLD: k3 KL higher with R3")
    noisy_f2 = [1.0e-3, 2.0e-3, 0.5e-3]
    partly = _verdicts([_arm("grpo", ACC, k3=HIGH, f2=noisy_f2), _arm("grpo_r3", ACC, k3=LOW, f2=[1.1e-3, 1.2e-3,
                                                                                                  1.4e-3])])
    assert _key(partly, mech).startswith("PARTLY: k3 KL lower with R3")
    zero = [0.0, 0.0, 0.0]
    only_kl = _verdicts([_arm("grpo", ACC, k3=HIGH, f2=zero), _arm("grpo_r3", ACC, k3=LOW, f2=zero)])
    v, evidence = only_kl[next(k for k in only_kl if k.startswith(mech))]
    assert v.startswith("HELD: k3 KL lower with R3") and any("0 in both arms" in e for e in evidence)
    # no engine gap (fp32 control): the mechanism is not judged there
    control = _verdicts([_arm("grpo", ACC, engine="fp32", k3=HIGH, f2=HIGH),
                         _arm("grpo_r3", ACC, engine="fp32", k3=LOW, f2=LOW)])
    assert not any(k.startswith("R3 paper (mechanism)") for k in control)


def test_qwen_v2_on_policy_kl_without_reward_gain():
    on = "Qwen team: on-policy (1 update per batch) GRPO + R3 lowers the k3 KL without a reward gain"
    same = _verdicts([_arm("grpo", ACC, mini_batches=1, k3=HIGH, f2=HIGH),
                      _arm("grpo_r3", ACC, mini_batches=1, k3=LOW, f2=LOW)])
    assert _key(same, on).startswith("HELD")
    gain = _verdicts([_arm("grpo", ACC, mini_batches=1, k3=HIGH, f2=HIGH),
                      _arm("grpo_r3", [a + 0.1 for a in ACC], mini_batches=1, k3=LOW, f2=LOW)])
    assert _key(gain, on).startswith("DID NOT HOLD: R3 gains in training reward and final held-out accuracy")
    flat = _verdicts([_arm("grpo", ACC, mini_batches=1, k3=[1e-3, 2e-3, 1e-3], f2=HIGH),
                      _arm("grpo_r3", ACC, mini_batches=1, k3=[2e-3, 1e-3, 1.1e-3], f2=LOW)])
    assert _key(flat, on).startswith("not resolved")


@pytest.mark.parametrize("updates, r2, r3, start", [
    (2, 0.8, 0.6, "HELD"), (2, 0.6, 0.8, "DID NOT HOLD"), (4, 0.6, 0.8, "HELD"), (4, 0.8, 0.6, "DID NOT HOLD"),
    (4, 0.7, 0.7, "DID NOT HOLD: no difference"),
])
def test_qwen_v2_r2_vs_r3_by_updates_per_batch(updates, r2, r3, start):
    noise = (0.0, 0.004, -0.003)
    v = _verdicts([_arm("grpo", [0.5 + n for n in noise], mini_batches=updates),
                   _arm("grpo_r2", [r2 + n for n in noise], mini_batches=updates),
                   _arm("grpo_r3", [r3 + n for n in noise[::-1]] if r2 != r3 else [r3 + n for n in noise],
                        mini_batches=updates)])
    words = "GRPO + R2 >= GRPO + R3" if updates == 2 else "GRPO + R3 >= GRPO + R2"
    assert _key(v, f"Qwen team: at {updates} updates per batch {words}").startswith(
        start if r2 != r3 else "not resolved"), v


def test_edge_of_band_is_marked_and_listed():
    # d = [0.1, 0.0, 0.2]: mean 0.1, 2 SE = 2 * 0.1 / sqrt(3) = 0.1155 -> |d| / 2SE = 0.87: at the edge
    c = compare_values({0: 0.1, 1: 0.0, 2: 0.2}, {0: 0, 1: 0, 2: 0}, "a", "b", "final_acc")
    assert c.at_edge and EDGE_MARK in c.line()
    # d = [0.3, 0.29, 0.31]: far beyond the band; d = [0.01, -0.2, 0.2]: far within it
    assert not compare_values({0: 0.3, 1: 0.29, 2: 0.31}, {0: 0, 1: 0, 2: 0}, "a", "b", "final_acc").at_edge
    assert not compare_values({0: 0.01, 1: -0.2, 2: 0.2}, {0: 0, 1: 0, 2: 0}, "a", "b", "final_acc").at_edge
    arms = [_arm("grpo", [0.5, 0.5, 0.5], mini_batches=4), _arm("grpo_r2", [0.5, 0.5, 0.5], mini_batches=4),
            _arm("grpo_r3", [0.6, 0.5, 0.7], mini_batches=4)]
    listed = edge_claims(claims({a.name: a for a in arms}))
    assert "Qwen team: at 4 updates per batch GRPO + R3 >= GRPO + R2 [s]" in listed


def test_the_report_reads_the_testbed_rule_on_the_run():
    from megagspo.ablation.report import _testbed_rule_lines

    ok = _arm("gspo", [0.7, 0.6, 0.8], mini_batches=4)  # cold start 0.5 on every seed (_arm)
    low = _arm("gspo", [0.7, 0.4, 0.8], setting="t", mini_batches=2)
    assert _testbed_rule_lines({"s/gspo": ok})[0].endswith("ends above its cold start on every seed.")
    line = _testbed_rule_lines({"t/gspo": low})[0]
    assert "NOT MET on seed 1 (0.500 -> 0.400)" in line
    assert _testbed_rule_lines({"s/gspo": ok, "t/gspo": low}) == _testbed_rule_lines({"s/gspo": ok})  # 4 > 2
    assert _testbed_rule_lines({"s/grpo": _arm("grpo", ACC)}) == []


def test_missing_mismatch_metrics_are_nan_not_errors():
    arm = _arm("grpo", ACC)  # a v1 run: no mismatch/* rows
    t = arm_table(arm)
    assert math.isnan(t["k3_kl"][0]) and math.isnan(t["route_pair"][0]) and t["final_acc"][0] == pytest.approx(0.7)
    v = _verdicts([arm, _arm("grpo_r3", ACC)])
    assert _key(v, "R3 paper (mechanism)").startswith("NOT TESTABLE")


# ------------------------------------------------------------------------------------ machine and the report
def test_cpu_info_reads_the_model_name_and_the_vector_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2GHz\ncpu family\t: 6\nmodel\t\t: 143\n"
                    "stepping\t: 8\nflags\t\t: fpu avx2 avx512f amx_bf16\n\nprocessor\t: 1\nmodel name\t: other\n")
    info = cpu_info(str(path))
    assert info == {"cpu": "Some CPU @ 2GHz", "cpu_id": "family 6 model 143 stepping 8",
                    "cpu_flags": "avx2 avx512f amx_bf16"}
    assert cpu_info(str(tmp_path / "absent")) == {}
    record_machine(str(tmp_path / "out"))
    record_machine(str(tmp_path / "out"))  # the same machine twice: named once
    lines = machine_lines(str(tmp_path / "out"))
    assert lines[0] == "Ran on:" and len(lines) == 3 and "cores; torch" in lines[1]
    assert machine_lines(str(tmp_path / "none"))[0].startswith("Machine: not recorded")


def _fake_run(spec, cell, seed, acc, k3, f2):
    run_dir = spec.cell_dir(cell, seed)
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(spec.cell_config(cell, seed, []).to_dict(), f)
    rows = [{"phase": "rl", "step": s, "reward/mean": acc, "clip/tok_frac": 0.01, "clip/seq_frac": 0.01,
             "moe/expert_volatility": 0.05, "kl/approx_old": 1e-4, "time/step_s": 0.3, "eval/accuracy": acc,
             "eval/fresh": 1.0 if s == 3 else 0.0, "mismatch/route_pair_frac": 0.1, "mismatch/route_token_frac": 0.2,
             "mismatch/k3_kl": k3, "mismatch/frac_over_ln2": f2} for s in range(4)]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"cold_start/accuracy": 0.5, "final/accuracy": acc, "rl/time_s": 1.0}, f)


def test_report_shows_the_machine_the_mismatch_per_cell_the_control_and_the_edges(tmp_path):
    spec = load_ablation(V2, out_dir=str(tmp_path / "out"), arms=["grpo", "grpo_r3"],
                         settings=["fp32_on_policy", "fp8_off_policy_4x"])
    for seed in spec.seeds:
        for cell in spec.cells():
            stress, r3 = cell.startswith("fp8"), cell.endswith("r3")
            _fake_run(spec, cell, seed, 0.6 + 0.01 * seed, 1e-3 if stress and r3 else 2e-3 + 1e-5 * seed,
                      1e-4 if stress and r3 else 3e-4)
    record_machine(spec.out_dir)
    text = open(write_report(spec)).read()
    assert "Ran on:" in text and "## Engine-trainer mismatch per cell" in text
    assert "| fp8_off_policy_4x/grpo_r3 | fp8_sim | 0.1000 ± 0.0000 |" in text
    assert "Control fp32_on_policy (fp32 engine, 1 update): fp32_on_policy/grpo_r3 equals fp32_on_policy/grpo" in text
    assert "R3 paper (mechanism): GRPO + R3 lowers the k3 KL and F(tau=2) against GRPO without replay" in text
    assert "### Verdicts at the edge of their band" in text
    assert "Testbed rule, condition 1" not in text  # no GSPO arm in this subset
    assert os.path.getsize(os.path.join(spec.out_dir, "ablation_mismatch_fp8_off_policy_4x.png")) > 1000
