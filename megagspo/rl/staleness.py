"""How old the consumed tokens are: the versions between the weights that sampled each token and the update that
trains on it, read by the sources that generate ahead (one step ahead with partial rollouts, the producer).

Legend (docs/architecture.md): R responses, L response length.
"""

from __future__ import annotations

from megagspo.rollout.base import RolloutOutput
from moe.parallel import ParallelDims


def token_staleness(dims: ParallelDims, out: RolloutOutput, version: int, step: int, partial: bool) -> dict:
    """Staleness of the consumed tokens (versions between the weights that sampled them and this update: `step`),
    each token's version from out.version_RL, else `version` (the batch's). With partial rollouts also how many
    responses were continued under newer weights, and the share of tokens sampled under a version older than their
    response's newest (the tokens an update overtook)."""
    mask_RL = out.sampled_RL
    version_RL = out.versions_RL(version)
    stale_RL = (step - version_RL).double().masked_fill(~mask_RL, 0.0)
    newest_R1 = version_RL.masked_fill(~mask_RL, -1).amax(1, keepdim=True) if mask_RL.numel() else version_RL
    overtaken_RL = mask_RL & (version_RL < newest_R1)
    sums = [float(mask_RL.sum()), float(stale_RL.sum()), float(mask_RL[stale_RL > 0].sum()), float(overtaken_RL.sum()),
            float(overtaken_RL.any(1).sum()) if mask_RL.numel() else 0.0, float(mask_RL.shape[0])]
    total, stale_sum, stale_tokens, overtaken, continued, rows = dims.dp_sum(sums)
    most = max(v[0] for v in dims.dp_gather([float(stale_RL.max()) if stale_RL.numel() else 0.0]))
    metrics = {"rollout/staleness_mean": stale_sum / max(total, 1.0), "rollout/staleness_max": most,
               "rollout/stale_token_frac": stale_tokens / max(total, 1.0)}
    if partial:
        metrics.update({"rollout/older_version_token_frac": overtaken / max(total, 1.0),
                        "rollout/continued_response_frac": continued / max(rows, 1.0)})
    return metrics
