"""The ablation report: per-arm curves (mean and spread over seeds), a table of final numbers, and a verdict
on each of the GSPO paper's three claims that the arms present can test.

    Figure 1: GSPO trains more efficiently than GRPO (training reward, held-out accuracy).
    Figure 2: GSPO clips far more tokens than GRPO (paper: ~2 orders of magnitude) yet learns better.
    Figure 3: GRPO on an MoE model needs routing replay to converge.

Verdicts use a two-standard-error rule over seeds. Arms of one seed share its cold start, data order and first
rollouts, so when both arms have the same seeds the comparison is paired: d_s = a_s - b_s per seed, and a
difference counts when |mean d| > 2 * sd(d) / sqrt(n). (Unpaired, the spread of the cold starts between seeds
would swamp any arm effect.) Otherwise: |mean_a - mean_b| > 2 * sqrt(s_a^2/n_a + s_b^2/n_b). With one seed
there is no spread and a verdict is marked as indicative only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from moe.json_files import loads_bounded, read_json

from megagspo.ablation.spec import AblationSpec
from megagspo.config import read_yaml_mapping


@dataclass
class CellResult:
    arm: str
    seed: int
    config: dict
    summary: dict
    rl_rows: List[dict]
    cold_start_accuracy: float


@dataclass
class ArmResult:
    name: str
    config: dict
    cells: List[CellResult] = field(default_factory=list)

    @property
    def role(self) -> str:
        """gspo | grpo_replay | grpo | other — what the claims compare."""
        rl = self.config["rl"]
        if rl["loss"] in ("gspo", "gspo_token"):
            return "gspo"
        if rl["loss"] == "grpo":
            return "grpo_replay" if rl["routing_replay"] in ("r2", "r3") else "grpo"
        return "other"

    def label(self) -> str:
        rl = self.config["rl"]
        replay = "" if rl["routing_replay"] == "none" else f" + {rl['routing_replay'].upper()} replay"
        return f"{self.name} ({rl['loss']}{replay}, clip {rl['clip_low']:g}/{rl['clip_high']:g})"


# ------------------------------------------------------------------------------------------------- loading
def _read_rows(path: str) -> List[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(loads_bounded(line, path))
    return rows


def load_results(spec: AblationSpec) -> Tuple[Dict[str, ArmResult], List[str]]:
    """Finished cells of every arm. -> ({arm: ArmResult}, [folders that are missing or unfinished])."""
    arms: Dict[str, ArmResult] = {}
    missing = []
    for arm in spec.arms:
        for seed in spec.seeds:
            run_dir = spec.cell_dir(arm, seed)
            paths = [os.path.join(run_dir, n) for n in ("summary.json", "metrics.jsonl", "config.yaml")]
            if not all(os.path.isfile(p) for p in paths):
                missing.append(run_dir)
                continue
            summary = read_json(paths[0])
            rows = _read_rows(paths[1])
            config = read_yaml_mapping(paths[2], "run config")  # the recipe reader: size, depth, duplicate keys
            rl = [r for r in rows if r.get("phase") == "rl"]
            if not rl or "final/accuracy" not in summary:
                missing.append(run_dir)
                continue
            cell = CellResult(arm, seed, config, summary, rl, float(summary["cold_start/accuracy"]))
            arms.setdefault(arm, ArmResult(arm, config)).cells.append(cell)
    return arms, missing


# ------------------------------------------------------------------------------------------------ statistics
def mean_std(values: List[float]) -> Tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def smooth(values: List[float], window: int) -> List[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _tail_mean(cell: CellResult, key: str, frac: float = 0.2) -> float:
    vals = [r[key] for r in cell.rl_rows]
    k = max(1, int(round(len(vals) * frac)))
    return sum(vals[-k:]) / k


def _all_mean(cell: CellResult, key: str) -> float:
    vals = [r[key] for r in cell.rl_rows]
    return sum(vals) / len(vals)


def arm_table(arm: ArmResult) -> Dict[str, Tuple[float, float]]:
    """Per-arm final numbers as (mean, std over seeds)."""
    def agg(fn):
        return mean_std([fn(c) for c in arm.cells])

    return {
        "cold_start_acc": agg(lambda c: c.cold_start_accuracy),
        "final_acc": agg(lambda c: float(c.summary["final/accuracy"])),
        "delta_acc": agg(lambda c: float(c.summary["final/accuracy"]) - c.cold_start_accuracy),
        "final_sampled_acc": agg(lambda c: float(c.summary.get("final/sampled_accuracy", float("nan")))),
        "reward_tail": agg(lambda c: _tail_mean(c, "reward/mean")),
        "reward_mean": agg(lambda c: _all_mean(c, "reward/mean")),
        "tok_clip": agg(lambda c: _all_mean(c, "clip/tok_frac")),
        "seq_clip": agg(lambda c: _all_mean(c, "clip/seq_frac")),
        "volatility": agg(lambda c: _all_mean(c, "moe/expert_volatility")),
        "kl": agg(lambda c: _all_mean(c, "kl/approx_old")),
        "step_s": agg(lambda c: _all_mean(c, "time/step_s")),
        "rl_time_s": agg(lambda c: float(c.summary.get("rl/time_s", float("nan")))),
    }


@dataclass
class Comparison:
    a: str
    b: str
    metric: str
    diff: float
    two_se: float     # nan with one seed per arm
    paired: bool = False

    @property
    def significant(self) -> Optional[bool]:
        if math.isnan(self.two_se):
            return None
        return abs(self.diff) > self.two_se

    def text(self) -> str:
        if math.isnan(self.two_se):
            return f"{self.diff:+.3f} (one seed: no spread, indicative only)"
        how = "paired over seeds" if self.paired else "unpaired"
        return (f"{self.diff:+.3f} (2 SE = {self.two_se:.3f}, {how}: "
                f"{'beyond' if self.significant else 'within'} seed noise)")


def _per_seed(arm: ArmResult, metric: str) -> Dict[int, float]:
    return {c.seed: arm_table(ArmResult(arm.name, arm.config, [c]))[metric][0] for c in arm.cells}


def compare(a: ArmResult, b: ArmResult, metric: str) -> Comparison:
    """a - b on `metric`: paired over seeds when both arms have the same seeds (see the module docstring)."""
    va, vb = _per_seed(a, metric), _per_seed(b, metric)
    if set(va) == set(vb):
        diffs = [va[s] - vb[s] for s in sorted(va)]
        mean, sd = mean_std(diffs)
        two_se = 2 * sd / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        return Comparison(a.name, b.name, metric, mean, two_se, paired=True)
    (ma, sa), (mb, sb) = mean_std(list(va.values())), mean_std(list(vb.values()))
    na, nb = len(va), len(vb)
    two_se = 2 * math.sqrt(sa ** 2 / na + sb ** 2 / nb) if na > 1 and nb > 1 else float("nan")
    return Comparison(a.name, b.name, metric, ma - mb, two_se, paired=False)


def _verdict(cmp: Comparison, positive: str, negative: str) -> str:
    if cmp.diff == 0:
        return "DID NOT HOLD: no difference between the arms"
    if cmp.significant is None:
        return "indicative only (one seed): " + (positive if cmp.diff > 0 else negative)
    if cmp.significant:
        return positive if cmp.diff > 0 else negative
    return "not resolved at this scale (difference within seed noise)"


def _two_metric_verdict(acc: Comparison, rew: Comparison, a: str, b: str) -> str:
    """Held-out accuracy and training reward together: both for `a` beyond noise -> HELD; either for `b`
    beyond noise -> DID NOT HOLD; one for `a`, the other within noise -> PARTLY."""
    names = {"final_acc": "final held-out accuracy", "reward_tail": "training reward"}
    if acc.significant is None or rew.significant is None:
        return _verdict(acc, f"HELD: {a} ends with higher held-out accuracy",
                        f"DID NOT HOLD: {b} ends with higher held-out accuracy")
    against = [names[c.metric] for c in (acc, rew) if c.significant and c.diff < 0]
    favour = [names[c.metric] for c in (acc, rew) if c.significant and c.diff > 0]
    if against:
        rest = f"; {', '.join(favour)} favours {a}" if favour else ""
        return f"DID NOT HOLD: {b} is higher in {' and '.join(against)}, beyond seed noise{rest}"
    if len(favour) == 2:
        return f"HELD: {a} is higher in both held-out accuracy and training reward, beyond seed noise"
    if favour:
        return f"PARTLY: {a} is higher in {favour[0]} beyond seed noise; the other is within noise"
    return "not resolved at this scale (both differences within seed noise)"


def claims(arms: Dict[str, ArmResult]) -> List[Tuple[str, str, List[str]]]:
    """[(claim, verdict, evidence lines)] for the claims the present arms can test."""
    by_role: Dict[str, ArmResult] = {}
    for arm in arms.values():
        by_role.setdefault(arm.role, arm)
    out = []
    gspo, grpo_rr, grpo = by_role.get("gspo"), by_role.get("grpo_replay"), by_role.get("grpo")
    baseline = grpo_rr or grpo
    if gspo and baseline:
        acc = compare(gspo, baseline, "final_acc")
        rew = compare(gspo, baseline, "reward_tail")
        verdict = _two_metric_verdict(acc, rew, "GSPO", "GRPO")
        out.append(("Figure 1: GSPO trains more efficiently than GRPO", verdict, [
            f"final held-out accuracy, {gspo.name} - {baseline.name}: {acc.text()}",
            f"training reward over the last 20% of steps, {gspo.name} - {baseline.name}: {rew.text()}"]))
        g_tok, b_tok = arm_table(gspo)["tok_clip"][0], arm_table(baseline)["tok_clip"][0]
        learns = acc.diff >= 0 or acc.significant is False
        if g_tok == 0:
            verdict = "DID NOT HOLD: GSPO clipped no token"
        elif b_tok == 0:
            verdict = ("HELD: GSPO clipped tokens and GRPO none, and GSPO learns at least as well" if learns else
                       "PARTLY: GSPO clipped tokens and GRPO none, but GSPO learns worse here")
        elif (ratio := g_tok / b_tok) >= 10 and learns:
            orders = math.log10(ratio)
            # the paper's Figure 2: ~0.15 vs ~0.0013, about 115x; >= 50x (1.7 orders) rounds to "two orders"
            size = "" if ratio >= 50 else " — the direction holds, the size (paper: ~2 orders) does not"
            verdict = (f"HELD: GSPO clips {ratio:.0f}x more tokens ({orders:.1f} orders of magnitude) and learns at "
                       f"least as well{size}")
        elif ratio >= 10:
            verdict = f"PARTLY: GSPO clips {ratio:.0f}x more tokens, but learns worse here"
        else:
            verdict = f"DID NOT HOLD: GSPO clips only {ratio:.2f}x as many tokens as GRPO"
        out.append(("Figure 2: GSPO clips far more tokens than GRPO yet learns better", verdict, [
            f"mean fraction of tokens clipped: {gspo.name} {g_tok:.4f}, {baseline.name} {b_tok:.6f}"]))
    if grpo_rr and grpo:
        acc = compare(grpo_rr, grpo, "final_acc")
        rew = compare(grpo_rr, grpo, "reward_tail")
        vol = arm_table(grpo)["volatility"][0]
        verdict = _two_metric_verdict(acc, rew, "GRPO with routing replay", "GRPO without routing replay")
        out.append(("Figure 3: GRPO on MoE needs routing replay to converge", verdict, [
            f"final held-out accuracy, {grpo_rr.name} - {grpo.name}: {acc.text()}",
            f"training reward over the last 20% of steps, {grpo_rr.name} - {grpo.name}: {rew.text()}",
            f"expert-activation volatility without replay (top-k choices changed per update): {vol:.4f} "
            "(the paper reports ~10% on the 48-layer Qwen3-30B-A3B)"]))
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
def write_plots(arms: Dict[str, ArmResult], out_dir: str) -> Dict[str, str]:
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

    grpo_arms = {n: a for n, a in arms.items() if a.role in ("grpo", "grpo_replay")}
    if any(a.role == "grpo" for a in grpo_arms.values()) and any(a.role == "grpo_replay" for a in grpo_arms.values()):
        replay_first = dict(sorted(grpo_arms.items(), key=lambda kv: kv[1].role != "grpo_replay"))
        fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
        reward_acc_axes(axes[0][0], axes[0][1], replay_first)
        paired_axes(axes[1][0], axes[1][1], replay_first)
        fig.suptitle("GRPO with vs without routing replay; bottom: paired differences (same seed)")
        save(fig, "routing_replay", "ablation_routing_replay.png")
    return written


# ---------------------------------------------------------------------------------------------------- report
def _fmt(ms: Tuple[float, float], digits: int = 3) -> str:
    mean, std = ms
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


# Over 60 lines: report.md written top to bottom, one section after another.
def write_report(spec: AblationSpec, command: str = "") -> str:
    """Writes <out>/report.md and the PNGs next to it. -> path of report.md. Raises FileNotFoundError when no
    arm has a finished run."""
    arms, missing = load_results(spec)
    if not arms:
        raise FileNotFoundError(f"no finished runs under {spec.out_dir} (looked for {', '.join(missing[:3])} ...)")
    os.makedirs(spec.out_dir, exist_ok=True)
    plots = write_plots(arms, spec.out_dir)
    lines = [f"# Ablation report: {spec.name}", ""]
    if command:
        lines += [f"Reproduce: `{command}`", ""]
    cfg0 = next(iter(arms.values())).config
    seeds = sorted({c.seed for a in arms.values() for c in a.cells})
    lines += [f"Base recipe `{spec.base}`; seeds {seeds}; cold start: "
              + ("one SFT per seed shared by every arm" if spec.cold_start == "sft" else "the recipe's model.init_from")
              + f"; {cfg0['rl']['steps']} RL steps of {cfg0['rl']['prompts_per_step']} prompts x "
              f"{cfg0['rl']['group_size']} samples, {cfg0['rl']['mini_batches']} updates per step, "
              f"lr {cfg0['rl']['lr']:g}. Held-out accuracy: greedy decoding on {cfg0['data']['eval_size']} "
              "problems never trained on.", ""]
    lines += ["## Arms", "", "| arm | differs from the base recipe in | seeds finished |", "|---|---|---|"]
    for name in spec.arms:
        over = ", ".join(f"`{k}={v}`" for k, v in spec.arms[name].items()) or "(nothing: the base recipe)"
        done = len(arms[name].cells) if name in arms else 0
        lines.append(f"| {name} | {over} | {done} of {len(spec.seeds)} |")
    lines.append("")
    if missing:
        lines += ["Missing or unfinished runs (not in the numbers below): " + ", ".join(f"`{m}`" for m in missing), ""]
    spread = "mean ± std over seeds" if len(seeds) > 1 else "one seed"
    lines += [f"## Final numbers ({spread})", "",
              "| arm | cold-start acc | final held-out acc | Δ acc | final sampled acc | train reward (last 20%) "
              "| tokens clipped | sequences clipped | expert volatility | approx KL(old‖θ) | s / step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in arms.items():
        t = arm_table(arm)
        lines.append(f"| {name} | {_fmt(t['cold_start_acc'])} | {_fmt(t['final_acc'])} | {_fmt(t['delta_acc'])} | "
                     f"{_fmt(t['final_sampled_acc'])} | {_fmt(t['reward_tail'])} | {_fmt(t['tok_clip'], 5)} | "
                     f"{_fmt(t['seq_clip'], 4)} | {_fmt(t['volatility'], 4)} | {_fmt(t['kl'], 5)} | "
                     f"{_fmt(t['step_s'], 2)} |")
    lines += ["", "Clip fractions, volatility and KL are means over all RL steps. Expert volatility: the fraction of "
              "top-k expert choices that differ between pi_theta (after each update) and pi_old on the same tokens "
              "(with replay, measured in an extra forward without replay).", ""]
    verdicts = claims(arms)
    if verdicts:
        lines += ["## The paper's claims at this scale", ""]
        for claim, verdict, evidence in verdicts:
            lines.append(f"- **{claim}** — {verdict}.")
            lines += [f"  - {e}" for e in evidence]
        lines.append("")
    lines += ["## Plots", ""]
    titles = {"reward_accuracy": "Training reward and held-out accuracy (Figure 1)",
              "clip_fraction": "Clipped-token fraction (Figure 2)",
              "expert_volatility": "Expert-activation volatility",
              "routing_replay": "GRPO with vs without routing replay (Figure 3)"}
    for key, name in plots.items():
        lines += [f"### {titles[key]}", "", f"![{titles[key]}]({name})", ""]
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

        json.dump({name: {k: {"mean": clean(m), "std": clean(s)} for k, (m, s) in arm_table(arm).items()}
                   for name, arm in arms.items()}, f, indent=1)
    return path
