"""The published claims an ablation can test, each judged by a rule fixed before any run (docs/ablation.md):

    GSPO paper (Zheng et al. 2025), per setting:
      Figure 1  GSPO trains more efficiently than GRPO (held-out accuracy and training reward)
      Figure 2  GSPO clips far more tokens than GRPO (paper: ~2 orders of magnitude) yet learns at least as well
      Figure 3  GRPO on an MoE model needs routing replay to converge
    R3 paper (Qwen3-30B-A3B), per setting: final score GRPO < GSPO < GRPO + R3 < GSPO + R3
    Qwen team, "Stabilizing RL with LLMs", across settings (off-policy degree = updates per rollout batch):
      on-policy (1 update per batch) needs no routing replay; at 2 updates R2 is best, at 4 or more R3 is best;
      and (what both imply) routing replay matters more off-policy than on-policy.

The one statistical rule under all of them: arms of one seed share its cold start, data order and first
rollouts, so a comparison of two arms with the same seeds is paired: d_s = a_s - b_s per seed, and a difference
counts ("beyond seed noise") when |mean d| > 2 * sd(d) / sqrt(n). Unpaired (different seeds): |mean_a - mean_b|
> 2 * sqrt(s_a^2/n_a + s_b^2/n_b). With one seed there is no spread: a verdict is "indicative only". A claim
that one arm is above several others is HELD when every pair is beyond noise in the claimed direction, DID NOT HOLD
when any pair is beyond noise the other way, PARTLY when some pairs are beyond noise in the claimed direction and
none against, and "not resolved at this scale" when every pair is within noise. A claim of no benefit (on-policy
needs no replay) is HELD when no replay arm is above the no-replay arm beyond noise, and DID NOT HOLD otherwise.
None of these rules looks at what the paper reported. One exception is structural, not statistical: with 1 update
per batch every importance ratio is exactly 1, so Figure 2's clipping claim is reported NOT TESTABLE there.

Arms are recognised by their config (loss family, rl.routing_replay), settings by rl.batch.mini_batches, so a recipe
may name them as it likes.

Added for the ablation v2 (issue 47), fixed before its run. A "stress" setting is one whose rollout engine computes
in another precision than the fp32 trainer (rollout.engine_dtype bf16 | fp16 | fp8_sim). The mismatch metrics are
per-cell means over all RL steps of the per-step metrics on loss tokens (megagspo.ablation.results.MISMATCH_METRICS).
    R3 paper, mechanism (each stress setting, for GRPO and for GSPO): R3 lowers the k3 KL between the engine and
      pi_old and F(tau=2) against the same loss without replay. "Lower" is "above" on (none - R3), per metric; the
      two metrics are combined as Figures 1 and 3 combine accuracy and reward (HELD: both lower beyond noise; DID NOT
      HOLD: either higher beyond noise; PARTLY: one lower, the other within noise). A metric that is exactly 0 in
      both arms on every seed cannot move and is left out of the verdict, which then rests on the other.
    Qwen team, v2 (stress settings): at 1 update per batch R3 lowers the k3 KL without a reward gain (HELD: KL lower
      beyond noise and neither the training reward nor held-out accuracy of GRPO + R3 above GRPO's beyond noise; DID
      NOT HOLD: the KL higher beyond noise, or a reward / accuracy gain beyond noise; else not resolved); at 2 updates
      R2 >= R3 and at 4 (or more) R3 >= R2 on held-out accuracy, each one pair judged by the "above" rule (within the
      band: not resolved).
    The edge of a band: a comparison whose |mean d| lies between 2/3 and 3/2 of its 2 SE is "at the edge": a rerun on
    another machine may move it across (the v1 report's one beyond-noise verdict, +0.078 at 2 SE 0.068, read +0.073
    at 2 SE 0.075 on another CPU). Its evidence line says so, and the report lists every verdict that rests on one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megagspo.ablation.results import ArmResult, arm_table, mean_std, per_seed

# metric name -> words, for the evidence lines
METRIC_WORDS = {"final_acc": "final held-out accuracy", "reward_tail": "training reward (last 20% of steps)",
                "k3_kl": "k3 KL (engine vs pi_old, mean over steps)", "f2": "F(tau=2) (mean over steps)"}
# |mean d| / (2 SE) in [EDGE_LOW, EDGE_HIGH]: the verdict sits at the edge of its band (module docstring)
EDGE_LOW, EDGE_HIGH = 2 / 3, 3 / 2
EDGE_MARK = "AT THE EDGE of its band"
SCIENTIFIC = ("k3_kl", "f2")  # metrics whose evidence lines are written as 1.23e-03


# ------------------------------------------------------------------------------------------------ statistics
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

    @property
    def at_edge(self) -> bool:
        """|diff| within [2/3, 3/2] of its 2 SE band: a rerun may flip beyond <-> within (module docstring)."""
        if math.isnan(self.two_se) or self.two_se == 0:
            return False
        return EDGE_LOW <= abs(self.diff) / self.two_se <= EDGE_HIGH

    def text(self) -> str:
        # the mismatch metrics are ~1e-3 and below: three decimals would read 0.000
        fmt = (lambda v: f"{v:+.2e}") if self.metric in SCIENTIFIC else (lambda v: f"{v:+.3f}")
        if math.isnan(self.two_se):
            return f"{fmt(self.diff)} (one seed: no spread, indicative only)"
        how = "paired over seeds" if self.paired else "unpaired"
        edge = f"; {EDGE_MARK}" if self.at_edge else ""
        return (f"{fmt(self.diff)} (2 SE = {fmt(self.two_se)[1:]}, {how}: "
                f"{'beyond' if self.significant else 'within'} seed noise{edge})")

    def line(self) -> str:
        return f"{METRIC_WORDS.get(self.metric, self.metric)}, {self.a} - {self.b}: {self.text()}"


def compare_values(va: Dict[int, float], vb: Dict[int, float], a: str, b: str, metric: str) -> Comparison:
    """a - b from per-seed values {seed: value}: paired when both have the same seeds (module docstring). Seeds
    whose value is nan (a metric the run did not log) are left out."""
    va = {s: v for s, v in va.items() if not math.isnan(v)}
    vb = {s: v for s, v in vb.items() if not math.isnan(v)}
    if not va or not vb:
        return Comparison(a, b, metric, float("nan"), float("nan"), paired=False)
    if set(va) == set(vb):
        diffs = [va[s] - vb[s] for s in sorted(va)]
        mean, sd = mean_std(diffs)
        two_se = 2 * sd / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        return Comparison(a, b, metric, mean, two_se, paired=True)
    (ma, sa), (mb, sb) = mean_std(list(va.values())), mean_std(list(vb.values()))
    na, nb = len(va), len(vb)
    two_se = 2 * math.sqrt(sa ** 2 / na + sb ** 2 / nb) if na > 1 and nb > 1 else float("nan")
    return Comparison(a, b, metric, ma - mb, two_se, paired=False)


# -------------------------------------------------------------------------------------------------- verdicts
def verdict(cmp: Comparison, positive: str, negative: str) -> str:
    if cmp.diff == 0:
        return "DID NOT HOLD: no difference between the arms"
    if cmp.significant is None:
        return "indicative only (one seed): " + (positive if cmp.diff > 0 else negative)
    if cmp.significant:
        return positive if cmp.diff > 0 else negative
    return "not resolved at this scale (difference within seed noise)"


def two_metric_verdict(acc: Comparison, rew: Comparison, a: str, b: str) -> str:
    """Held-out accuracy and training reward together: both for `a` beyond noise -> HELD; either for `b`
    beyond noise -> DID NOT HOLD; one for `a`, the other within noise -> PARTLY."""
    names = {"final_acc": "final held-out accuracy", "reward_tail": "training reward"}
    if acc.significant is None or rew.significant is None:
        return verdict(acc, f"HELD: {a} ends with higher held-out accuracy",
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


def above_verdict(pairs: Sequence[Comparison]) -> str:
    """Each comparison is (claimed higher) - (claimed lower). The module docstring's rule for "above"."""
    if any(c.significant is None for c in pairs):
        agree = sum(c.diff > 0 for c in pairs)
        return f"indicative only (one seed): {agree} of {len(pairs)} pairs in the claimed order"
    against = [c for c in pairs if c.significant and c.diff < 0]
    favour = [c for c in pairs if c.significant and c.diff > 0]
    if against:
        names = ", ".join(f"{c.b} above {c.a}" for c in against)
        return f"DID NOT HOLD: {names}, beyond seed noise"
    if len(favour) == len(pairs):
        return f"HELD: all {len(pairs)} pairs in the claimed order, beyond seed noise"
    if favour:
        return (f"PARTLY: {len(favour)} of {len(pairs)} pairs in the claimed order beyond seed noise, none against "
                "(the rest within noise)")
    return "not resolved at this scale (every pair within seed noise)"


def no_benefit_verdict(pairs: Sequence[Comparison]) -> str:
    """Each comparison is (arm claimed unnecessary) - (arm without it). HELD when none is above beyond noise."""
    if any(c.significant is None for c in pairs):
        return "indicative only (one seed): " + ("no replay arm above" if all(c.diff <= 0 for c in pairs)
                                                 else "a replay arm is above")
    above = [c for c in pairs if c.significant and c.diff > 0]
    if above:
        return "DID NOT HOLD: " + ", ".join(f"{c.a} is above {c.b}" for c in above) + ", beyond seed noise"
    if all(c.diff == 0 for c in pairs):
        return "HELD: the replay arms end exactly where the arm without replay does"
    below = [c for c in pairs if c.significant and c.diff < 0]
    if below:
        return ("HELD: no replay arm is above the arm without replay beyond seed noise; "
                + ", ".join(f"{c.a} is below {c.b}" for c in below) + " beyond noise")
    return "HELD: no replay arm is above the arm without replay beyond seed noise"


# ---------------------------------------------------------------------------------------------------- claims
Claim = Tuple[str, str, List[str]]  # (claim, verdict, evidence lines)


def compare(a: ArmResult, b: ArmResult, metric: str) -> Comparison:
    """a - b on `metric`: paired over seeds when both arms have the same seeds (the module docstring)."""
    return compare_values(per_seed(a, metric), per_seed(b, metric), a.name, b.name, metric)


def _setting_words(arms: Sequence[ArmResult]) -> str:
    arm = arms[0]
    if not arm.setting:
        return ""
    n = arm.updates_per_batch
    return f" [{arm.setting}: {n} update{'s' if n != 1 else ''} per rollout batch]"


def gspo_paper_claims(by_role: Dict[str, ArmResult], where: str = "") -> List[Claim]:
    """Figures 1-3 of the GSPO paper among the arms of one setting."""
    out: List[Claim] = []
    gspo, grpo = by_role.get("gspo"), by_role.get("grpo")
    grpo_rr = by_role.get("grpo_r2") or by_role.get("grpo_r3")  # the paper's GRPO baseline replays routes
    baseline = grpo_rr or grpo
    if gspo and baseline:
        acc, rew = compare(gspo, baseline, "final_acc"), compare(gspo, baseline, "reward_tail")
        out.append((f"Figure 1: GSPO trains more efficiently than GRPO{where}",
                    two_metric_verdict(acc, rew, "GSPO", "GRPO"), [acc.line(), rew.line()]))
        out.append((f"Figure 2: GSPO clips far more tokens than GRPO yet learns better{where}",
                    _clip_verdict(gspo, baseline, acc), [
                        f"mean fraction of tokens clipped: {gspo.name} {arm_table(gspo)['tok_clip'][0]:.4f}, "
                        f"{baseline.name} {arm_table(baseline)['tok_clip'][0]:.6f}"]))
    if grpo_rr and grpo:
        acc, rew = compare(grpo_rr, grpo, "final_acc"), compare(grpo_rr, grpo, "reward_tail")
        vol = arm_table(grpo)["volatility"][0]
        out.append((f"Figure 3: GRPO on MoE needs routing replay to converge{where}",
                    two_metric_verdict(acc, rew, "GRPO with routing replay", "GRPO without routing replay"), [
                        acc.line(), rew.line(),
                        f"expert-activation volatility without replay (top-k choices changed per update): {vol:.4f} "
                        "(the paper reports ~10% on the 48-layer Qwen3-30B-A3B)"]))
    return out


def _clip_verdict(gspo: ArmResult, baseline: ArmResult, acc: Comparison) -> str:
    g_tok, b_tok = arm_table(gspo)["tok_clip"][0], arm_table(baseline)["tok_clip"][0]
    learns = acc.diff >= 0 or acc.significant is False
    if g_tok == 0 and b_tok == 0 and gspo.updates_per_batch == 1:
        # The one update of a batch starts at pi_old: every ratio is exactly 1 and no loss can clip. The claim
        # is about off-policy updates; a "did not hold" here would judge something the setting cannot show.
        return "NOT TESTABLE in this setting: with 1 update per batch every ratio is 1, so nothing is clipped"
    if g_tok == 0:
        return "DID NOT HOLD: GSPO clipped no token"
    if b_tok == 0:
        return ("HELD: GSPO clipped tokens and GRPO none, and GSPO learns at least as well" if learns else
                "PARTLY: GSPO clipped tokens and GRPO none, but GSPO learns worse here")
    ratio = g_tok / b_tok
    if ratio >= 10 and learns:
        # the paper's Figure 2: ~0.15 vs ~0.0013, about 115x; >= 50x (1.7 orders) rounds to "two orders"
        size = "" if ratio >= 50 else " — the direction holds, the size (paper: ~2 orders) does not"
        return (f"HELD: GSPO clips {ratio:.0f}x more tokens ({math.log10(ratio):.1f} orders of magnitude) and learns "
                f"at least as well{size}")
    if ratio >= 10:
        return f"PARTLY: GSPO clips {ratio:.0f}x more tokens, but learns worse here"
    return f"DID NOT HOLD: GSPO clips only {ratio:.2f}x as many tokens as GRPO"


# The R3 paper's final scores on Qwen3-30B-A3B, lowest first: GRPO 48.8 (collapsed), GSPO 66.8, GRPO + R3 68.1,
# GSPO + R3 69.0.
R3_ORDER = ("grpo", "gspo", "grpo_r3", "gspo_r3")


def r3_paper_claim(by_role: Dict[str, ArmResult], where: str = "") -> List[Claim]:
    if not all(r in by_role for r in R3_ORDER):
        return []
    chain = [by_role[r] for r in R3_ORDER]
    pairs = [compare(hi, lo, "final_acc") for lo, hi in zip(chain, chain[1:])]
    return [(f"R3 paper: final accuracy GRPO < GSPO < GRPO + R3 < GSPO + R3{where}", above_verdict(pairs),
             [p.line() for p in pairs])]


def qwen_claims(settings: Dict[str, Dict[str, ArmResult]]) -> List[Claim]:
    """The Qwen team's on- vs off-policy claim over the GRPO arms of every setting (see the module docstring)."""
    out: List[Claim] = []
    on = {s: r for s, r in settings.items() if "grpo" in r and next(iter(r.values())).updates_per_batch == 1}
    off = {s: r for s, r in settings.items() if "grpo" in r and next(iter(r.values())).updates_per_batch > 1}
    for name, roles in on.items():
        pairs = [compare(roles[r], roles["grpo"], "final_acc") for r in ("grpo_r2", "grpo_r3") if r in roles]
        if pairs:
            out.append((f"Qwen team: on-policy (1 update per batch) GRPO needs no routing replay{_tag(name)}",
                        no_benefit_verdict(pairs), [p.line() for p in pairs]))
    for name, roles in off.items():
        n = next(iter(roles.values())).updates_per_batch
        best, others = ("grpo_r2", ("grpo", "grpo_r3")) if n == 2 else ("grpo_r3", ("grpo", "grpo_r2"))
        if best in roles and all(o in roles for o in others):
            pairs = [compare(roles[best], roles[o], "final_acc") for o in others]
            out.append((f"Qwen team: at {n} updates per batch GRPO + {best[-2:].upper()} is the best GRPO arm"
                        f"{_tag(name)}", above_verdict(pairs), [p.line() for p in pairs]))
    for on_name, on_roles in on.items():
        for off_name, off_roles in off.items():
            if next(iter(on_roles.values())).engine_dtype != next(iter(off_roles.values())).engine_dtype:
                continue  # on vs off-policy under the same engine only (the v2 fp32 control has no off-policy twin)
            pairs = []
            for r in ("grpo_r2", "grpo_r3"):
                if r in on_roles and r in off_roles:
                    gain_off = _minus(per_seed(off_roles[r], "final_acc"), per_seed(off_roles["grpo"], "final_acc"))
                    gain_on = _minus(per_seed(on_roles[r], "final_acc"), per_seed(on_roles["grpo"], "final_acc"))
                    pairs.append(compare_values(gain_off, gain_on, f"({r} - grpo) at {off_name}",
                                                f"({r} - grpo) at {on_name}", "final_acc"))
            if pairs:
                out.append((f"Qwen team: routing replay helps GRPO more off-policy ({off_name}) than on-policy "
                            f"({on_name})", above_verdict(pairs), [p.line() for p in pairs]))
    return out


def _tag(setting: str) -> str:
    return f" [{setting}]" if setting else ""


def _minus(a: Dict[int, float], b: Dict[int, float]) -> Dict[int, float]:
    return {s: a[s] - b[s] for s in a if s in b}


# ------------------------------------------------------------------------------------------ v2: the mechanism
def _all_zero(a: ArmResult, b: ArmResult, metric: str) -> bool:
    vals = list(per_seed(a, metric).values()) + list(per_seed(b, metric).values())
    return all(v == 0 for v in vals)


def lower_verdict(cmps: Sequence[Comparison], what: str) -> str:
    """Each comparison is (without replay) - (with replay) on a metric the replay should lower: the Figures 1 / 3
    combination of two metrics (module docstring), for one or two metrics."""
    if any(c.significant is None for c in cmps):
        agree = sum(c.diff > 0 for c in cmps)
        return f"indicative only (one seed): {agree} of {len(cmps)} metrics lower with {what}"
    names = [METRIC_WORDS.get(c.metric, c.metric).split(" (")[0] for c in cmps]
    against = [n for n, c in zip(names, cmps) if c.significant and c.diff < 0]
    favour = [n for n, c in zip(names, cmps) if c.significant and c.diff > 0]
    if against:
        return f"DID NOT HOLD: {' and '.join(against)} higher with {what}, beyond seed noise"
    if len(favour) == len(cmps):
        return f"HELD: {' and '.join(favour)} lower with {what}, beyond seed noise"
    if favour:
        return f"PARTLY: {favour[0]} lower with {what} beyond seed noise; the other within noise"
    return "not resolved at this scale (every difference within seed noise)"


def r3_mechanism_claims(by_role: Dict[str, ArmResult], where: str = "") -> List[Claim]:
    """The R3 paper's mechanism at a stress setting: R3 lowers k3 KL and F(tau=2) against no replay (docstring)."""
    out: List[Claim] = []
    for family in ("grpo", "gspo"):
        none, r3 = by_role.get(family), by_role.get(f"{family}_r3")
        if not (none and r3 and none.stress_engine):
            continue
        cmps, notes = [], []
        for metric in ("k3_kl", "f2"):
            c = compare(none, r3, metric)
            if math.isnan(c.diff):
                notes.append(f"{METRIC_WORDS[metric]}: not logged by these runs")
            elif _all_zero(none, r3, metric):
                notes.append(f"{METRIC_WORDS[metric]}: 0 in both arms on every seed, left out of the verdict")
            else:
                cmps.append(c)
        verdict_text = (lower_verdict(cmps, "R3") if cmps else
                        "NOT TESTABLE: neither metric was measured or moved in these runs")
        out.append((f"R3 paper (mechanism): {family.upper()} + R3 lowers the k3 KL and F(tau=2) against "
                    f"{family.upper()} without replay{where}", verdict_text, [c.line() for c in cmps] + notes))
    return out


def qwen_v2_claims(settings: Dict[str, Dict[str, ArmResult]]) -> List[Claim]:
    """Qwen's v2 claims at the stress settings (module docstring): on-policy R3 lowers KL without a reward gain;
    R2 >= R3 at 2 updates per batch; R3 >= R2 at 4 or more."""
    out: List[Claim] = []
    for name, roles in settings.items():
        first = next(iter(roles.values()))
        if not first.stress_engine:
            continue
        n = first.updates_per_batch
        grpo, r2, r3 = roles.get("grpo"), roles.get("grpo_r2"), roles.get("grpo_r3")
        if n == 1 and grpo and r3:
            kl = compare(grpo, r3, "k3_kl")        # none - R3: > 0 is "R3 lowers"
            gains = [compare(r3, grpo, m) for m in ("reward_tail", "final_acc")]
            out.append((f"Qwen team: on-policy (1 update per batch) GRPO + R3 lowers the k3 KL without a reward "
                        f"gain{_tag(name)}", _kl_without_gain(kl, gains), [kl.line()] + [g.line() for g in gains]))
        if n >= 2 and r2 and r3:
            hi, lo = (r2, r3) if n == 2 else (r3, r2)
            cmp = compare(hi, lo, "final_acc")
            words = "R2 >= R3" if n == 2 else "R3 >= R2"
            out.append((f"Qwen team: at {n} updates per batch GRPO + {words[:2]} >= GRPO + {words[-2:]}{_tag(name)}",
                        above_verdict([cmp]), [cmp.line()]))
    return out


def _kl_without_gain(kl: Comparison, gains: Sequence[Comparison]) -> str:
    if math.isnan(kl.diff):
        return "NOT TESTABLE: the k3 KL was not logged by these runs"
    if kl.significant is None or any(g.significant is None for g in gains):
        return "indicative only (one seed): KL " + ("lower" if kl.diff > 0 else "not lower") + " with R3"
    gained = [METRIC_WORDS[g.metric].split(" (")[0] for g in gains if g.significant and g.diff > 0]
    if gained:
        return f"DID NOT HOLD: R3 gains in {' and '.join(gained)}, beyond seed noise"
    if kl.significant and kl.diff < 0:
        return "DID NOT HOLD: the k3 KL is higher with R3, beyond seed noise"
    if kl.significant:
        return "HELD: the k3 KL is lower with R3 beyond seed noise, and no reward or accuracy gain beyond noise"
    return "not resolved at this scale (the KL difference is within seed noise; no reward gain beyond noise)"


def edge_claims(verdicts: Sequence[Claim]) -> List[str]:
    """The claims whose verdict rests on a comparison at the edge of its band (module docstring)."""
    return [claim for claim, _, evidence in verdicts if any(EDGE_MARK in e for e in evidence)]


def claims(arms: Dict[str, ArmResult]) -> List[Claim]:
    """[(claim, verdict, evidence lines)] for every claim the present arms can test, setting by setting."""
    settings: Dict[str, Dict[str, ArmResult]] = {}
    for arm in arms.values():
        settings.setdefault(arm.setting, {}).setdefault(arm.role, arm)
    out: List[Claim] = []
    for roles in settings.values():
        where = _setting_words(list(roles.values()))
        out += gspo_paper_claims(roles, where)
        out += r3_paper_claim(roles, where)
        out += r3_mechanism_claims(roles, where)
    return out + qwen_claims(settings) + qwen_v2_claims(settings)
