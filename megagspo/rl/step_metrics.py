"""The RL step's logged row: its schema, from the counts summed over the data-parallel ranks and the loss's
metrics merged over them (megagspo.rl.step.RLStep.summarize gathers both)."""

from __future__ import annotations

from megagspo.agent.tools import TOOL_ERRORS
from moe.volatility import VolatilityTally

# loss metrics logged as they are (unions over the data-parallel ranks): megagspo.algorithm.rollout_correction
DIAGNOSTIC_PREFIXES = ("mismatch/", "rollout_correction/", "rollout_is/")


def metrics_row(total: dict, union: dict, grad_norms: list, lr: float, with_reference: bool) -> dict:
    """The logged row from the counts summed over the data-parallel ranks (`total`) and the loss's metrics
    merged over them (`union`)."""
    rows, gnorms = total["rows"], grad_norms
    row = {
        "reward/mean": total["reward"] / rows, "reward/accuracy": total["correct"] / rows,
        "reward/errors": total["reward_errors"], "reward/clamped": total["reward_clamped"],
        "reward/timeouts": total["reward_timeouts"],  # cut off at reward.timeout_s (also in reward/errors)
        "reward/nonzero_adv_frac": total["nonzero_adv"] / rows,
        "response/length_mean": total["response_tokens"] / rows,
        "moe/expert_volatility": VolatilityTally.fraction(total["vol_changed"], total["vol_total"]),
        "clip/seq_frac": union["seq/clip_frac"], "clip/tok_frac": union["tok/clip_frac"],
        "clip/seq_low_frac": union["seq/clip_low_frac"], "clip/seq_high_frac": union["seq/clip_high_frac"],
        "kl/approx_old": union["kl/approx_old"], "entropy/mean": union.get("entropy/mean", 0.0),
        "ratio/mean": union["ratio/mean"], "loss": union["loss"], "grad_norm": sum(gnorms) / len(gnorms),
        "grad_norm/max": max(gnorms), "lr": lr,
    }
    if with_reference:  # k3 KL to the reference per response token; the KL share of the loss
        row["kl/ref"], row["loss/kl"] = union["kl/ref"], union["loss/kl"]
    row.update({k: v for k, v in union.items() if k.startswith(DIAGNOSTIC_PREFIXES)})
    if "mismatch/is_weight_sq_mean" in union:  # the token IS weights' effective sample size, as a fraction
        row["mismatch/is_ess_frac"] = union["mismatch/is_weight_mean"] ** 2 / max(union["mismatch/is_weight_sq_mean"],
                                                                                    1e-30)
    return row


def mismatch_by_version(dims, micro_batches: list, old_logp: list, step: int, recomputed: bool) -> dict:
    """Partial rollouts: |log pi_old - log pi_rollout| per response token, apart for the tokens sampled by the
    weights this update starts from (version `step`: the engine-vs-trainer numerics only) and for those sampled by
    older versions (staleness on top), summed over the data-parallel ranks and the pipeline stages (pi_old lives
    on the LM-head stage; old_logp[i]: micro-batch i's, None on the other stages). {} unless the batch carries
    per-token versions and pi_old is `recomputed`."""
    if not recomputed or not micro_batches or micro_batches[0].seqs.version_T is None:
        return {}
    sums = [0.0, 0.0, 0.0, 0.0]
    for mb, logp in zip(micro_batches, old_logp):
        if logp is None:
            continue
        seqs = mb.seqs
        gap_T = (mb.tokens_of(logp).float() - seqs.rollout_logp_T).abs().double()
        for i, tokens_T in enumerate((seqs.loss_mask_T & (seqs.version_T == step),
                                      seqs.loss_mask_T & (seqs.version_T < step))):
            sums[2 * i] += float(gap_T[tokens_T].sum())
            sums[2 * i + 1] += float(tokens_T.sum())
    current, n_current, older, n_older = dims.pp_sum(dims.dp_sum(sums))
    return {"mismatch/abs_log_ratio_current_version": current / max(n_current, 1.0),
            "mismatch/abs_log_ratio_older_version": older / max(n_older, 1.0)}


def batch_metrics(dims, micro: list) -> dict:
    """The step's micro-batches (all of them, every mini-batch), over the data-parallel ranks (collective).
    batch/pad_fraction: padded / computed tokens of the step's micro-batches (0 when packed, but for the
    TP alignment); batch/tokens_per_micro_batch_min / _max: computed tokens per micro-batch over all ranks;
    batch/dp_tokens_max_over_mean: how unevenly the ranks' real tokens are spread."""
    computed = [float(mb.view.computed_tokens) for mb in micro]
    per_rank = dims.dp_gather([float(sum(mb.seqs.num_tokens for mb in micro)), sum(computed), min(computed),
                               max(computed)])
    real, total = (sum(r[i] for r in per_rank) for i in (0, 1))
    return {"batch/pad_fraction": 1.0 - real / total,
            "batch/tokens_per_micro_batch_min": min(r[2] for r in per_rank),
            "batch/tokens_per_micro_batch_max": max(r[3] for r in per_rank),
            # the fullest data-parallel rank's real tokens over the ranks' mean (1 = balanced)
            "batch/dp_tokens_max_over_mean": max(r[0] for r in per_rank) * len(per_rank) / max(real, 1.0)}


def agent_metrics(dims, out) -> dict:
    """Multi-turn trajectories' metrics (out.agent_rows; collective over the data-parallel ranks): turns and tool
    calls per trajectory, tool errors by kind, tool responses cut, template rewrites kept (prefix_policy keep), the
    shares cut by the length budget or ended at the turn limit, and the loss-mask-1 share of the tokens after the
    prompt (what the policy sampled, against tool, user and boundary tokens)."""
    rows = out.agent_rows
    local = {"rows": float(len(rows)), "turns": float(sum(r["turns"] for r in rows)),
             "tool_calls": float(sum(r["tool_calls"] for r in rows)),
             "tool_truncations": float(sum(r["tool_truncations"] for r in rows)),
             "prefix_rewrites": float(sum(r.get("prefix_rewrites", 0) for r in rows)),
             "truncated": float(sum(r["status"] == "truncated" for r in rows)),
             "max_turns": float(sum(r["status"] == "max_turns" for r in rows)),
             "sampled": float(out.sampled_RL.sum()), "tokens": float(out.response_mask_RL.sum())}
    local.update({f"error/{kind}": float(sum(r["tool_errors"].get(kind, 0) for r in rows)) for kind in TOOL_ERRORS})
    total = dict(zip(local, dims.dp_sum(list(local.values()))))
    n = max(total["rows"], 1.0)
    metrics = {"agent/turns_mean": total["turns"] / n, "agent/tool_calls_mean": total["tool_calls"] / n,
               "agent/tool_errors": sum(total[f"error/{kind}"] for kind in TOOL_ERRORS),
               "agent/tool_truncations": total["tool_truncations"], "agent/prefix_rewrites": total["prefix_rewrites"],
               "agent/truncated_frac": total["truncated"] / n, "agent/max_turns_frac": total["max_turns"] / n,
               "agent/mask1_frac": total["sampled"] / max(total["tokens"], 1.0)}
    metrics.update({f"agent/tool_errors/{kind}": total[f"error/{kind}"] for kind in TOOL_ERRORS})
    return metrics
