"""The ablation report: per-arm curves (mean and spread over seeds), a table of final numbers, the expert
volatility reached, and a verdict on each published claim the cells present can test (the claims and their
rules: megagspo.ablation.claims). With settings (arms x settings) the overlay plots are drawn per setting and
one figure shows every arm under each setting."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Tuple

from megagspo.ablation.claims import Comparison, claims, compare, edge_claims  # noqa: F401  (public names)
from megagspo.ablation.machine import machine_lines
from megagspo.ablation.results import (MISMATCH_METRICS, ArmResult, CellResult, arm_table, finite,  # noqa: F401
                                       load_results, mean_std)
from megagspo.ablation.spec import AblationSpec


def smooth(values: List[float], window: int) -> List[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


# ----------------------------------------------------------------------------------------------------- plots
def _series(cells: List[CellResult], key: str, window: int) -> Tuple[List[int], List[float], List[float], List[float]]:
    """Mean, min, max over seeds of a smoothed per-step metric, on the steps every seed has."""
    n = min(len(c.rl_rows) for c in cells)
    steps = [int(r["step"]) + 1 for r in cells[0].rl_rows[:n]]
    sm = [smooth([r[key] for r in c.rl_rows[:n]], window) for c in cells]
    mean = [sum(v[i] for v in sm) / len(sm) for i in range(n)]
    return steps, mean, [min(v[i] for v in sm) for i in range(n)], [max(v[i] for v in sm) for i in range(n)]


def _eval_points(cells: List[CellResult], key: str = "eval/accuracy"):
    """Held-out accuracy at the evaluation steps (cold start at step 0): steps, mean, std."""
    per_cell = []
    for c in cells:
        pts = {0: c.cold_start_accuracy} if key == "eval/accuracy" else {}
        for r in c.rl_rows:
            if r.get("eval/fresh", 0) > 0:
                pts[int(r["step"]) + 1] = float(r[key])
        per_cell.append(pts)
    steps = sorted(set.intersection(*[set(p) for p in per_cell]))
    stats = [mean_std([p[s] for p in per_cell]) for s in steps]
    return steps, [m for m, _ in stats], [0.0 if math.isnan(s) else s for _, s in stats]


# Over 60 lines: one matplotlib figure after another (curves, then bars), plotting code with no logic to split.
def write_plots(arms: Dict[str, ArmResult], out_dir: str, suffix: str = "") -> Dict[str, str]:
    """The overlay plots of these cells (one setting's, or all without settings); files ablation_<what><suffix>.png.
    -> {what: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: Dict[str, str] = {}
    colors = {}
    palette = ["tab:blue", "tab:red", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink"]
    for i, name in enumerate(arms):
        colors[name] = palette[i % len(palette)]
    steps_total = max(len(c.rl_rows) for a in arms.values() for c in a.cells)
    window = max(1, steps_total // 20)

    def save(fig, key, name):
        name = name[:-len(".png")] + suffix + ".png"
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written[key] = name

    def reward_acc_axes(ax_r, ax_a, selected):
        for name, arm in selected.items():
            steps, mean, lo, hi = _series(arm.cells, "reward/mean", window)
            ax_r.plot(steps, mean, color=colors[name], label=arm.label())
            ax_r.fill_between(steps, lo, hi, color=colors[name], alpha=0.2)
            es, em, ed = _eval_points(arm.cells)
            ax_a.errorbar(es, em, yerr=ed, color=colors[name], marker="o", capsize=3, label=arm.label())
        ax_r.set_xlabel("RL step"), ax_r.set_ylabel(f"training reward (moving avg {window})")
        ax_a.set_xlabel("RL step"), ax_a.set_ylabel("held-out accuracy (greedy)")
        ax_r.legend(fontsize=7), ax_a.legend(fontsize=7)

    def paired_axes(ax_r, ax_a, selected):
        """Each arm minus the reference arm, seed by seed (same cold start): the arm effect without the spread
        of the cold starts between seeds. Line = mean over seeds, band = min..max."""
        ref_name = next(iter(selected))
        ref = {c.seed: c for c in selected[ref_name].cells}
        for name, arm in list(selected.items())[1:]:
            cells = [c for c in arm.cells if c.seed in ref]
            if not cells:
                continue
            n = min(min(len(c.rl_rows) for c in cells), min(len(ref[c.seed].rl_rows) for c in cells))
            steps = [int(r["step"]) + 1 for r in cells[0].rl_rows[:n]]
            diffs = [[a - b for a, b in zip(smooth([r["reward/mean"] for r in c.rl_rows[:n]], window),
                                            smooth([r["reward/mean"] for r in ref[c.seed].rl_rows[:n]], window))]
                     for c in cells]
            ax_r.plot(steps, [sum(d[i] for d in diffs) / len(diffs) for i in range(n)], color=colors[name],
                      label=f"{name} - {ref_name}")
            ax_r.fill_between(steps, [min(d[i] for d in diffs) for i in range(n)],
                              [max(d[i] for d in diffs) for i in range(n)], color=colors[name], alpha=0.2)
            es, _, _ = _eval_points(cells)
            ref_pts = {s: dict(zip(*_eval_points([ref[s]])[:2])) for s in ref}
            own_pts = {c.seed: dict(zip(*_eval_points([c])[:2])) for c in cells}
            es = [s for s in es if all(s in ref_pts[c.seed] for c in cells)]
            d_acc = [[own_pts[c.seed][s] - ref_pts[c.seed][s] for c in cells] for s in es]
            ax_a.errorbar(es, [sum(v) / len(v) for v in d_acc],
                          yerr=[[sum(v) / len(v) - min(v) for v in d_acc], [max(v) - sum(v) / len(v) for v in d_acc]],
                          color=colors[name], marker="o", capsize=3, label=f"{name} - {ref_name}")
        for ax, what in ((ax_r, "training reward"), (ax_a, "held-out accuracy")):
            ax.axhline(0.0, color=colors[ref_name], ls="--", lw=1)
            ax.set_xlabel("RL step"), ax.set_ylabel(f"{what}: arm - {ref_name}, same seed")
            ax.legend(fontsize=7)

    n_seeds = max(len(a.cells) for a in arms.values())
    spread = f"{n_seeds} seeds: line = mean, band = min..max, bars = std" if n_seeds > 1 else "1 seed"
    if len(arms) > 1:
        fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
        reward_acc_axes(axes[0][0], axes[0][1], arms)
        paired_axes(axes[1][0], axes[1][1], arms)
    else:
        fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(12, 4.5))
        reward_acc_axes(ax_r, ax_a, arms)
    paired_note = "; bottom: each arm minus the first on the same seed (band, bars = min..max)" if len(arms) > 1 else ""
    fig.suptitle(f"Training reward and held-out accuracy per arm ({spread}){paired_note}")
    save(fig, "reward_accuracy", "ablation_reward_accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, arm in arms.items():
        steps, mean, lo, hi = _series(arm.cells, "clip/tok_frac", window)
        floor = 1e-5  # a log axis cannot show 0: steps with no clipped token sit on the floor
        ax.plot(steps, [max(v, floor) for v in mean], color=colors[name], label=arm.label())
        ax.fill_between(steps, [max(v, floor) for v in lo], [max(v, floor) for v in hi], color=colors[name], alpha=0.2)
    ax.set_yscale("log"), ax.set_xlabel("RL step"), ax.set_ylabel("fraction of tokens clipped")
    ax.set_title("Clipped-token fraction (GSPO clips whole sequences)"), ax.legend(fontsize=7)
    save(fig, "clip_fraction", "ablation_clip_fraction.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, arm in arms.items():
        steps, mean, lo, hi = _series(arm.cells, "moe/expert_volatility", window)
        ax.plot(steps, mean, color=colors[name], label=arm.label())
        ax.fill_between(steps, lo, hi, color=colors[name], alpha=0.2)
    ax.set_xlabel("RL step"), ax.set_ylabel("fraction of top-k expert choices changed")
    ax.set_title("Expert-activation volatility: pi_theta vs pi_old on the same tokens"), ax.legend(fontsize=7)
    save(fig, "expert_volatility", "ablation_expert_volatility.png")

    mismatch = [(MISMATCH_METRICS[k], label, log) for k, label, log in (
        ("route_pair", "route disagreement: (token, layer) top-k sets differing", False),
        ("k3_kl", "k3 KL, engine vs pi_old", True), ("f2", "F(tau=2): tokens with ratio beyond 2", True))]
    have = [m for m in mismatch if all(any(m[0] in r for r in c.rl_rows) for a in arms.values() for c in a.cells)]
    if have:
        fig, axes = plt.subplots(1, len(have), figsize=(5.2 * len(have), 4.2), squeeze=False)
        for ax, (key, label, log) in zip(axes[0], have):
            for name, arm in arms.items():
                cells = [c for c in arm.cells if all(key in r for r in c.rl_rows)]
                if not cells:
                    continue
                steps, mean, lo, hi = _series(cells, key, window)
                floor = 1e-7 if log else 0.0  # a log axis cannot show 0
                ax.plot(steps, [max(v, floor) for v in mean], color=colors[name], label=arm.label())
                ax.fill_between(steps, [max(v, floor) for v in lo], [max(v, floor) for v in hi], color=colors[name],
                                alpha=0.2)
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("RL step"), ax.set_ylabel(label), ax.legend(fontsize=6)
        fig.suptitle("Engine-trainer mismatch over steps (loss tokens; line = mean over seeds, band = min..max)")
        save(fig, "mismatch", "ablation_mismatch.png")

    grpo_arms = {n: a for n, a in arms.items() if a.role.startswith("grpo")}
    if any(a.role == "grpo" for a in grpo_arms.values()) and any(a.role != "grpo" for a in grpo_arms.values()):
        replay_first = dict(sorted(grpo_arms.items(), key=lambda kv: kv[1].role == "grpo"))
        fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
        reward_acc_axes(axes[0][0], axes[0][1], replay_first)
        paired_axes(axes[1][0], axes[1][1], replay_first)
        fig.suptitle("GRPO with vs without routing replay; bottom: paired differences (same seed)")
        save(fig, "routing_replay", "ablation_routing_replay.png")
    return written


def write_arm_plots(spec: AblationSpec, arms: Dict[str, ArmResult], out_dir: str) -> str:
    """One row per arm: training reward, held-out accuracy and expert volatility, a line per setting (mean over
    seeds, band = min..max). -> the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [a for a in spec.arms if any(r.arm == a for r in arms.values())]
    steps_total = max(len(c.rl_rows) for a in arms.values() for c in a.cells)
    window = max(1, steps_total // 20)
    palette = ["tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple"]
    fig, axes = plt.subplots(len(names), 3, figsize=(14, 3.2 * len(names)), squeeze=False)
    for row, arm_name in enumerate(names):
        ax_r, ax_a, ax_v = axes[row]
        cells = [r for r in arms.values() if r.arm == arm_name]
        for i, result in enumerate(cells):
            color = palette[i % len(palette)]
            label = result.setting or result.name
            for ax, key in ((ax_r, "reward/mean"), (ax_v, "moe/expert_volatility")):
                steps, mean, lo, hi = _series(result.cells, key, window)
                ax.plot(steps, mean, color=color, label=label)
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2)
            es, em, ed = _eval_points(result.cells)
            ax_a.errorbar(es, em, yerr=ed, color=color, marker="o", capsize=3, label=label)
        ax_r.set_ylabel(f"{arm_name}\ntraining reward (avg {window})")
        ax_a.set_ylabel("held-out accuracy (greedy)")
        ax_v.set_ylabel("top-k choices changed")
        for ax in (ax_r, ax_a, ax_v):
            ax.set_xlabel("RL step"), ax.legend(fontsize=7)
    fig.suptitle("Per arm: each setting's training reward, held-out accuracy and expert volatility "
                 "(line = mean over seeds, band = min..max, bars = std)")
    fig.tight_layout()
    name = "ablation_per_arm.png"
    fig.savefig(os.path.join(out_dir, name), dpi=80)
    plt.close(fig)
    return name


# ---------------------------------------------------------------------------------------------------- report
def _fmt(ms: Tuple[float, float], digits: int = 3) -> str:
    mean, std = ms
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


_PLOT_TITLES = {"reward_accuracy": "Training reward and held-out accuracy (Figure 1)",
                "clip_fraction": "Clipped-token fraction (Figure 2)",
                "expert_volatility": "Expert-activation volatility",
                "routing_replay": "GRPO with vs without routing replay (Figure 3)",
                "mismatch": "Engine-trainer mismatch over steps (route disagreement, k3 KL, F(2))"}


def _all_plots(spec: AblationSpec, arms: Dict[str, ArmResult]) -> List[Tuple[str, str]]:
    """[(title, file name)]: the overlay plots (per setting when there are settings), then the per-arm figure."""
    out: List[Tuple[str, str]] = []
    groups = {s: {n: a for n, a in arms.items() if a.setting == s} for s in (spec.settings or [""])}
    for setting, group in groups.items():
        if not group:
            continue
        for key, name in write_plots(group, spec.out_dir, f"_{setting}" if setting else "").items():
            out.append((_PLOT_TITLES[key] + (f", {setting}" if setting else ""), name))
    out.append(("Per arm", write_arm_plots(spec, arms, spec.out_dir)))
    return out


def _arms_section(spec: AblationSpec, arms: Dict[str, ArmResult]) -> List[str]:
    def over(flat):
        return ", ".join(f"`{k}={v}`" for k, v in flat.items()) or "(nothing: the base recipe)"

    finished = "seeds finished" if not spec.settings else "runs finished (seeds x settings)"
    lines = ["## Arms", "", f"| arm | differs from the base recipe in | {finished} |", "|---|---|---|"]
    for name in spec.arms:
        done = sum(len(a.cells) for a in arms.values() if a.arm == name)
        lines.append(f"| {name} | {over(spec.arms[name])} | {done} of {len(spec.seeds) * max(1, len(spec.settings))} |")
    lines.append("")
    if spec.settings:
        lines += ["## Settings (every arm runs under every setting)", "", "| setting | sets |", "|---|---|"]
        lines += [f"| {name} | {over(flat)} |" for name, flat in spec.settings.items()]
        lines.append("")
    return lines


def _volatility_section(arms: Dict[str, ArmResult]) -> List[str]:
    """The expert volatility reached without routing replay, per setting: what the replay arms are up against."""
    lines = ["## Expert volatility reached", "",
             "The fraction of (token, MoE layer, top-k) expert choices under the policy being trained that differ "
             "from pi_old's on the same response tokens, averaged over all RL steps, measured in every arm alike in "
             "a free forward after each update (1..K of the K updates of a rollout batch; runs before 2026-11-29 "
             "measured the arms without replay in the training forward, after 0..K-1 updates). Under R3 pi_old's "
             "routes are the engine's, so its volatility includes the engine-trainer route gap. The GSPO paper "
             "reports ~10% on the 48-layer Qwen3-30B-A3B.", ""]
    rows = [a for a in arms.values() if a.config["rl"]["routing_replay"] == "none"]
    if not rows:
        return lines + ["No arm without routing replay: nothing to report.", ""]
    lines += ["| arm without replay | updates per batch | volatility (mean ± std over seeds) |", "|---|---|---|"]
    for a in rows:
        lines.append(f"| {a.name} | {a.updates_per_batch} | {_fmt(arm_table(a)['volatility'], 4)} |")
    return lines + [""]


def _incomplete(spec: AblationSpec, missing: List[str], failed: List[str]) -> List[str]:
    """The report's first lines when cells are missing: which, and which of them failed in this ablation's
    run (their logs are in <out>/logs/), so that numbers over fewer seeds or arms are not read as the whole."""
    if not missing:
        return []
    total = len(spec.cells()) * len(spec.seeds)
    failed_here = [m for m in missing if m in set(failed)]
    lines = [f"**Incomplete: {len(missing)} of {total} cell runs are not in the numbers below.**"]
    if failed_here:
        lines.append("Failed: " + ", ".join(f"`{m}`" for m in failed_here) + f" (logs in `{spec.out_dir}/logs/`).")
    rest = [m for m in missing if m not in set(failed_here)]
    if rest:
        lines.append("Missing or unfinished runs (not run yet, interrupted, or failed before): "
                     + ", ".join(f"`{m}`" for m in rest) + ". Rerunning the ablation runs or resumes them.")
    return lines + [""]


def _mismatch_section(arms: Dict[str, ArmResult]) -> List[str]:
    """Per cell the engine-trainer route disagreement and the mismatch metrics (means over RL steps, then over
    seeds), and the fp32 control's check that replay changes nothing where the engine has no gap."""
    if not any(finite(arm_table(a)["route_pair"][0]) or finite(arm_table(a)["k3_kl"][0]) for a in arms.values()):
        return []
    lines = ["## Engine-trainer mismatch per cell", "",
             "Means over all RL steps of the per-step metrics on loss tokens (docs/ablation.md, \"Testbed v2\"), then "
             "mean ± std over seeds. Route disagreement: the share of (token, MoE layer) top-k expert sets that differ "
             "between the rollout engine and the trainer at pi_old (per token: in at least one layer). k3 KL and "
             "F(tau) compare the engine's token log-probs with pi_old's; token_mult_prob_error = mean exp|Δlogp|; "
             "IS ESS = effective sample size of the token IS weights / tokens. Replay override: R2 / R3 arms, the "
             "share of replayed (token, layer) routes that differ from the live router's choice.", "",
             "| setting / arm | engine | route disagreement (pairs) | (tokens) | k3 KL | F(2) | F(5) | mean abs Δlogp "
             "| token_mult_prob_error | IS ESS | replay override | expert volatility |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        t = arm_table(arm)
        lines.append(f"| {name} | {arm.engine_dtype} | {_fmt(t['route_pair'], 4)} | {_fmt(t['route_token'], 4)} | "
                     f"{_fmt_sci(t['k3_kl'])} | {_fmt_sci(t['f2'])} | {_fmt_sci(t['f5'])} | "
                     f"{_fmt(t['abs_log_ratio'], 4)} | {_fmt(t['mult_err'], 4)} | {_fmt(t['is_ess'], 4)} | "
                     f"{_fmt(t['override'], 4)} | {_fmt(t['volatility'], 4)} |")
    return lines + [""] + _control_lines(arms) + _testbed_rule_lines(arms) + [""]


def _testbed_rule_lines(arms: Dict[str, ArmResult]) -> List[str]:
    """The testbed v2 rule's condition 1 (docs/ablation.md) read on this run: GSPO without replay at the most
    off-policy stress setting ends above its cold start on every seed."""
    stress = [a for a in arms.values() if a.role == "gspo" and a.stress_engine]
    if not stress:
        return []
    arm = max(stress, key=lambda a: a.updates_per_batch)
    below = [f"seed {c.seed} ({c.cold_start_accuracy:.3f} -> {c.summary['final/accuracy']:.3f})"
             for c in sorted(arm.cells, key=lambda c: c.seed) if c.summary["final/accuracy"] <= c.cold_start_accuracy]
    return [f"- Testbed rule, condition 1 ({arm.name}, {arm.updates_per_batch} updates per batch, {arm.engine_dtype} "
            "engine): " + ("GSPO without replay ends above its cold start on every seed." if not below else
                           "NOT MET on " + ", ".join(below) + ": the testbed's premise fails on this run.")]


def _control_lines(arms: Dict[str, ArmResult]) -> List[str]:
    """Settings without an engine gap at 1 update per batch (the fp32 control): each replay arm should equal its
    arm without replay run for run; the report says whether it does."""
    lines = []
    for setting in sorted({a.setting for a in arms.values()}):
        roles = {a.role: a for a in arms.values() if a.setting == setting}
        first = next(iter(roles.values()))
        if first.stress_engine or first.updates_per_batch != 1:
            continue
        for family in ("grpo", "gspo"):
            base = roles.get(family)
            if not base:
                continue
            acc = {c.seed: c.summary["final/accuracy"] for c in base.cells}
            for role, arm in roles.items():
                if role.startswith(family + "_"):
                    same = all(acc.get(c.seed) == c.summary["final/accuracy"] for c in arm.cells)
                    lines.append(f"- Control {setting or '(no setting)'} ({first.engine_dtype} engine, 1 update): "
                                 f"{arm.name} {'equals' if same else 'DIFFERS FROM'} {base.name} run for run "
                                 "(final held-out accuracy on every seed)" + ("." if same else ": the control failed."))
    return lines


def _fmt_sci(ms: Tuple[float, float]) -> str:
    mean, std = ms
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.2e}" if math.isnan(std) else f"{mean:.2e} ± {std:.1e}"


# Over 60 lines: report.md written top to bottom, one section after another.
def write_report(spec: AblationSpec, command: str = "", failed: Optional[List[str]] = None) -> str:
    """Writes <out>/report.md and the PNGs next to it. -> path of report.md. Raises FileNotFoundError when no
    arm has a finished run. failed: run folders whose run failed in this invocation (named as failed)."""
    arms, missing = load_results(spec)
    if not arms:
        raise FileNotFoundError(f"no finished runs under {spec.out_dir} (looked for {', '.join(missing[:3])} ...)")
    os.makedirs(spec.out_dir, exist_ok=True)
    plots = _all_plots(spec, arms)
    lines = [f"# Ablation report: {spec.name}", ""]
    lines += _incomplete(spec, missing, failed or [])
    if command:
        lines += [f"Reproduce: `{command}`", ""]
    lines += machine_lines(spec.out_dir)
    cfg0 = next(iter(arms.values())).config
    seeds = sorted({c.seed for a in arms.values() for c in a.cells})
    rl0, batch0 = cfg0["rl"], cfg0["rl"]["batch"]
    updates = (f"{batch0['mini_batches']} updates per step" if not spec.settings else
               "updates per step as the setting says")
    lines += [f"Base recipe `{spec.base}`; seeds {seeds}; cold start: "
              + ("one SFT per seed shared by every arm" if spec.cold_start == "sft" else "the recipe's model.init_from")
              + f"; {rl0['steps']} RL steps of {batch0['prompts_per_step']} prompts x "
              f"{batch0['group_size']} samples, {updates}, "
              f"lr {rl0['optim']['lr']:g}. Held-out accuracy: greedy decoding on {cfg0['data']['eval_size']} "
              "problems never trained on.", ""]
    lines += _arms_section(spec, arms)
    spread = "mean ± std over seeds" if len(seeds) > 1 else "one seed"
    cell_word = "arm" if not spec.settings else "setting / arm"
    lines += [f"## Final numbers ({spread})", "",
              f"| {cell_word} | cold-start acc | final held-out acc | Δ acc | final sampled acc | train reward (last 20%) "
              "| tokens clipped | sequences clipped | expert volatility | approx KL(old‖θ) | s / step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        t = arm_table(arm)
        lines.append(f"| {name} | {_fmt(t['cold_start_acc'])} | {_fmt(t['final_acc'])} | {_fmt(t['delta_acc'])} | "
                     f"{_fmt(t['final_sampled_acc'])} | {_fmt(t['reward_tail'])} | {_fmt(t['tok_clip'], 5)} | "
                     f"{_fmt(t['seq_clip'], 4)} | {_fmt(t['volatility'], 4)} | {_fmt(t['kl'], 5)} | "
                     f"{_fmt(t['step_s'], 2)} |")
    lines += ["", "Clip fractions, volatility and KL are means over all RL steps.", ""]
    lines += _volatility_section(arms)
    lines += _mismatch_section(arms)
    verdicts = claims(arms)
    if verdicts:
        lines += ["## The published claims at this scale", "",
                  "Each verdict follows a rule fixed before the runs (megagspo/ablation/claims.py, docs/ablation.md): "
                  "paired differences over seeds, beyond seed noise when |mean| > 2 SE. \"not resolved\" means "
                  "the difference is within seed noise, not that the claim is false.", ""]
        for claim, verdict, evidence in verdicts:
            lines.append(f"- **{claim}** — {verdict}.")
            lines += [f"  - {e}" for e in evidence]
        lines.append("")
        edges = edge_claims(verdicts)
        lines += ["### Verdicts at the edge of their band", "",
                  "A comparison whose |mean difference| lies between 2/3 and 3/2 of its 2 SE band may cross it on a "
                  "rerun on another machine (megagspo/ablation/claims.py)."
                  + (" These verdicts rest on one:" if edges else " No verdict rests on one."), ""]
        lines += [f"- {c}" for c in edges] + ([""] if edges else [])
    lines += ["## Plots", ""]
    for title, name in plots:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    per_seed = ["## Per seed", "", "| arm | seed | cold-start acc | final acc | final sampled acc | RL time (s) |",
                "|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        for c in sorted(arm.cells, key=lambda c: c.seed):
            per_seed.append(f"| {name} | {c.seed} | {c.cold_start_accuracy:.3f} | {c.summary['final/accuracy']:.3f} | "
                            f"{c.summary.get('final/sampled_accuracy', float('nan')):.3f} | "
                            f"{c.summary.get('rl/time_s', float('nan')):.0f} |")
    lines += per_seed + [""]
    path = os.path.join(spec.out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(os.path.join(spec.out_dir, "report.json"), "w") as f:
        def clean(v):
            return None if math.isnan(v) else v

        table = {name: {k: {"mean": clean(m), "std": clean(s)} for k, (m, s) in arm_table(arm).items()}
                 for name, arm in arms.items()}
        # "_claims" cannot be a cell name (cells are [a-z]... or setting/arm)
        table["_claims"] = [{"claim": c, "verdict": v, "evidence": e} for c, v, e in verdicts]
        json.dump(table, f, indent=1)
    return path
