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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megagspo.ablation.results import ArmResult, arm_table, mean_std, per_seed

# metric name -> words, for the evidence lines
METRIC_WORDS = {"final_acc": "final held-out accuracy", "reward_tail": "training reward (last 20% of steps)"}


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

    def text(self) -> str:
        if math.isnan(self.two_se):
            return f"{self.diff:+.3f} (one seed: no spread, indicative only)"
        how = "paired over seeds" if self.paired else "unpaired"
        return (f"{self.diff:+.3f} (2 SE = {self.two_se:.3f}, {how}: "
                f"{'beyond' if self.significant else 'within'} seed noise)")

    def line(self) -> str:
        return f"{METRIC_WORDS.get(self.metric, self.metric)}, {self.a} - {self.b}: {self.text()}"


def compare_values(va: Dict[int, float], vb: Dict[int, float], a: str, b: str, metric: str) -> Comparison:
    """a - b from per-seed values {seed: value}: paired when both have the same seeds (module docstring)."""
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
    return out + qwen_claims(settings)
