"""Loss metrics as 0-dim tensors: nothing here calls .item() or branches on values, so computing them
inside the loss never syncs the device. Convert to floats only at logging time.

Legend (docs/architecture.md): T packed tokens, N packed sequences (spelled `_S` in names here).

Keys (all float tensors):
  seq/count, seq/nonempty, seq/empty           sequences in the micro-batch; with / without response tokens
  seq/clip_frac, seq/clip_low_frac, seq/clip_high_frac
                                               fraction of non-empty sequences clipped (token losses: with
                                               any clipped token); low side = A<0 and ratio<1-eps_low
  tok/count                                    response tokens
  tok/clip_frac, tok/clip_low_frac, tok/clip_high_frac
                                               fraction of response tokens whose objective took the clipped
                                               branch (GSPO: every token of a clipped sequence)
  ratio/mean, ratio/min, ratio/max, ratio/count
                                               s_i over non-empty sequences (GSPO, GSPO-token) or w_t over
                                               response tokens (GRPO); 1.0 when there is nothing to average
  loss, loss/policy, loss/kl                   this micro-batch's share of the global loss (detached)
  rollout_is/*                                 only with the rollout importance correction (old_policy.py)
  kl/approx_old                                k3 estimate of KL(pi_old || pi_theta) per response token
  entropy/mean                                 only when entropy_T is given
Fractions of an empty set are 0. `merge_metrics` combines micro-batch dicts exactly using the counts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

# Each averaged key and the count that weights it when micro-batches are merged.
_WEIGHTS = {
    "seq/clip_frac": "seq/nonempty",
    "seq/clip_low_frac": "seq/nonempty",
    "seq/clip_high_frac": "seq/nonempty",
    "tok/clip_frac": "tok/count",
    "tok/clip_low_frac": "tok/count",
    "tok/clip_high_frac": "tok/count",
    "kl/approx_old": "tok/count",
    "kl/ref": "tok/count",
    "entropy/mean": "tok/count",
    "ratio/mean": "ratio/count",
    "rollout_is/mean": "seq/nonempty",
    "rollout_is/truncated_frac": "seq/nonempty",
    "rollout_is/log_ratio_mean": "seq/nonempty",
    "mismatch/abs_log_ratio": "tok/count",
    "mismatch/k3_kl": "tok/count",
    "mismatch/frac_over_ln2": "tok/count",
    "mismatch/frac_over_ln5": "tok/count",
    "mismatch/token_mult_prob_error": "tok/count",
    "mismatch/is_weight_mean": "tok/count",
    "mismatch/is_weight_sq_mean": "tok/count",
}
# the rollout-correction menu's metrics (megagspo.algorithm.rollout_correction): rollout_correction/<mode>/<what>
_WEIGHTS.update({f"rollout_correction/{mode}/{what}": weight
                 for mode in ("token_tis", "token_mask")
                 for what, weight in (("token_frac", "tok/count"), ("seq_frac", "seq/nonempty"),
                                      ("weight_mean", "tok/count"))})
_WEIGHTS.update({f"rollout_correction/{mode}/{what}": "seq/nonempty"
                 for mode in ("seq_mask_geo", "opsm") for what in ("seq_frac", "weight_mean")})
_SUMS = ("seq/count", "seq/nonempty", "seq/empty", "tok/count", "ratio/count", "loss", "loss/policy", "loss/kl")


def _frac(num: Tensor, den: Tensor) -> Tensor:
    return num / den.clamp(min=1.0)


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    valid_f = valid.to(x.dtype)
    return _frac((torch.where(valid, x, torch.zeros_like(x))).sum(), valid_f.sum())


def masked_min_max_mean(x: Tensor, valid: Tensor) -> dict:
    one = torch.ones((), dtype=x.dtype, device=x.device)
    any_valid = valid.any()
    lo = torch.where(valid, x, torch.full_like(x, float("inf"))).amin() if x.numel() else one
    hi = torch.where(valid, x, torch.full_like(x, float("-inf"))).amax() if x.numel() else one
    return {
        "mean": torch.where(any_valid, masked_mean(x, valid), one),
        "min": torch.where(any_valid, lo, one),
        "max": torch.where(any_valid, hi, one),
    }


def approx_kl_old(log_ratio_T: Tensor, mask_T: Tensor) -> Tensor:
    """k3 estimate of KL(pi_old || pi_theta) from samples of pi_old: exp(r) - 1 - r, r = log w_t."""
    r_T = torch.where(mask_T, log_ratio_T.detach(), torch.zeros_like(log_ratio_T))
    return masked_mean(torch.expm1(r_T) - r_T, mask_T)


def clip_metrics(
    *,
    ratio_X: Tensor,
    valid_X: Tensor,
    clip_low_tok: Tensor,
    clip_high_tok: Tensor,
    clip_low_seq: Tensor,
    clip_high_seq: Tensor,
    mask_T: Tensor,
    lengths_S: Tensor,
    log_ratio_T: Tensor,
    entropy_T: Optional[Tensor] = None,
) -> dict:
    """Shared body: `_X` is the level the ratio lives on (S for GSPO/GSPO-token, T for GRPO).

    *_tok are per-token clip decisions (bool, T), *_seq per-sequence ones (bool, S).
    """
    f = lengths_S.dtype
    nonempty_S = lengths_S > 0
    seq_nonempty = nonempty_S.to(f).sum()
    tok_count = mask_T.to(f).sum()
    m = {
        "seq/count": torch.tensor(float(lengths_S.shape[0]), dtype=f, device=lengths_S.device),
        "seq/nonempty": seq_nonempty,
        "seq/empty": (~nonempty_S).to(f).sum(),
        "seq/clip_frac": _frac((clip_low_seq | clip_high_seq).to(f).sum(), seq_nonempty),
        "seq/clip_low_frac": _frac(clip_low_seq.to(f).sum(), seq_nonempty),
        "seq/clip_high_frac": _frac(clip_high_seq.to(f).sum(), seq_nonempty),
        "tok/count": tok_count,
        "tok/clip_frac": _frac((clip_low_tok | clip_high_tok).to(f).sum(), tok_count),
        "tok/clip_low_frac": _frac(clip_low_tok.to(f).sum(), tok_count),
        "tok/clip_high_frac": _frac(clip_high_tok.to(f).sum(), tok_count),
        "kl/approx_old": approx_kl_old(log_ratio_T, mask_T),
    }
    for k, v in masked_min_max_mean(ratio_X.detach(), valid_X).items():
        m[f"ratio/{k}"] = v
    m["ratio/count"] = valid_X.to(f).sum()
    if entropy_T is not None:
        m["entropy/mean"] = masked_mean(entropy_T.detach().to(f), mask_T)
    return m


def merge_metrics(parts: Sequence[dict]) -> dict:
    """Combine per-micro-batch metric dicts as if computed on the union (counts summed, fractions and
    means weighted by their counts, min of mins, max of maxes). Losses are summed: each micro-batch's
    loss is already divided by the global counts."""
    if not parts:
        raise ValueError("merge_metrics needs at least one metrics dict")
    out = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if key.endswith("/min") or key.endswith("/max"):
            # Parts with nothing to measure hold the 1.0 placeholder: leave them out of the extreme.
            count_key = "ratio/count" if key.startswith("ratio/") else "seq/nonempty"
            has = torch.stack([p[count_key] for p in parts]) > 0
            v = torch.stack(vals)
            fill = float("inf") if key.endswith("/min") else float("-inf")
            v = torch.where(has, v, torch.full_like(v, fill))
            ext = v.amin() if key.endswith("/min") else v.amax()
            out[key] = torch.where(has.any(), ext, torch.ones_like(ext))
        elif key in _SUMS:
            out[key] = torch.stack(vals).sum()
        else:
            weight_key = _WEIGHTS.get(key)
            if weight_key is None:
                raise KeyError(f"merge_metrics does not know how to combine metric {key!r}")
            w = torch.stack([p[weight_key] for p in parts])
            out[key] = _frac((torch.stack(vals) * w).sum(), w.sum())
    return out
