"""The RL step's logged row: its schema, from the counts summed over the data-parallel ranks and the loss's
metrics merged over them (megagspo.rl.step.RLStep.summarize gathers both)."""

from __future__ import annotations

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
