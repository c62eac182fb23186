#!/usr/bin/env python
"""The verdicts of tools/gpu_check.sh: one line per goal from the benchmarks' --json files, and the final table.

    python tools/gpu_goals.py step|logits|hidden|peers|tiny|producer OUT   one stage's verdict line (the cause column)
    python tools/gpu_goals.py summary OUT [--budget S] ...      the table (stdout) and OUT/summary.json

Standard library only: it must print on a host where torch or the project does not import. The goals (issue 25):
  step       forward+backward of 4 Qwen3-30B-A3B-width layers, 2 x 4,096 tokens, bf16, k >= 4 micro-batches per
             optimizer step: >= 240 model TFLOP/s (stretch 277; below 200 not done); the optimizer reported apart
  logits     log-prob forward from logits, T = 32,768, V = 151,936, bf16: <= 1.3 x one read of the logits;
             backward <= 1.3 x a read plus a write
  gspo       segmented GSPO loss, 32,768 tokens, forward+backward: <= 2 x a trivial elementwise kernel
  hidden     log-probs from hidden states, T = 16,384, H = 2,048, V = 151,936: >= 475 TFLOP/s at <= 0.65 GiB extra
  tiny       the tiny recipe in bf16 through `megagspo train` (tests/test_gpu_trainer.py): RL tokens/s, reported
  producer   the same with the producer process at staleness 2, partial rollouts and R3: both processes' peak memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# the trainer end to end right after the build: a first window learns in two minutes whether the trainer runs
STAGES = ["env", "install", "build", "tiny-bf16", "contract", "producer", "t-model", "t-kernels", "step", "kernels", "varlen", "lp-logits",
          "lp-hidden", "packing", "gpu-tests", "peers"]
GOALS = {  # name: (file, what, goal text)
    "step": ("step.json", "model step fwd+bwd TFLOP/s (k >= 4)", ">= 240 (stretch 277; < 200 not done)"),
    "optimizer": ("step.json", "optimizer step, share of a k = 8 step", "reported"),
    "logits-fwd": ("logits.json", "log-prob fwd from logits / one read", "<= 1.3x"),
    "logits-bwd": ("logits.json", "log-prob bwd from logits / read+write", "<= 1.3x"),
    "gspo": ("logits.json", "segmented GSPO loss fwd+bwd / trivial kernel", "<= 2x"),
    "hidden": ("hidden.json", "log-probs from hidden states", ">= 475 TF/s at <= 0.65 GiB extra"),
    "tiny": ("tiny-bf16.json", "the tiny recipe's RL steps, bf16, end to end", "reported beside the CPU's"),
    "producer": ("producer.json", "N = 2 producer + partial + R3: both processes' peak memory", "reported"),
}


def _load(out: str, name: str):
    path = os.path.join(out, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _path_row(doc, path: str):
    for row in doc.get("results", []):
        if row.get("path") == path:
            return row
    return None


def verdict_step(out: str) -> dict:
    doc = _load(out, "step.json")
    row = doc and _path_row(doc, "grouped+sdpa")
    if not row or "fwd_bwd_tflops" not in row:
        return {"step": ("no result", "missing"), "optimizer": ("no result", "missing")}
    tf = row["fwd_bwd_tflops"]
    status = "met (stretch)" if tf >= 277 else "met" if tf >= 240 else "missed" if tf >= 200 else "missed (< 200: not done)"
    k = row.get("micro_batches", doc.get("micro_batches"))
    step = (f"{tf:.0f} TF/s fwd+bwd at k={k} ({row.get('fwd_bwd_ms_per_micro_batch', float('nan')):.1f} ms/micro-batch, "
            f"peak {row.get('peak_gib', float('nan')):.1f} GiB)", status)
    others = [r for r in doc.get("results", []) if r.get("path") != "grouped+sdpa"]
    if others:  # the A/B paths (GPU_CHECK_STEP_PATHS): each against the default, for the next default's choice
        step = (step[0] + "; " + ", ".join(f"{r['path']} {r['fwd_bwd_tflops']:.0f} TF/s ({r['fwd_bwd_tflops'] / tf:.2f}x)"
                                           if r.get("fwd_bwd_tflops") else f"{r.get('path')} did not run"
                                           for r in others), step[1])
    opt = (f"{row.get('optimizer_ms', float('nan')):.1f} ms/step, {100 * row.get('optimizer_share_k8', float('nan')):.1f}% "
           f"of a k=8 step", "reported")
    return {"step": step, "optimizer": opt}


def verdict_logits(out: str) -> dict:
    doc = _load(out, "logits.json")
    if not doc:
        return {g: ("no result", "missing") for g in ("logits-fwd", "logits-bwd", "gspo")}
    res = {}
    best = {}
    for key, yard in (("fwd", "fwd_x_read"), ("bwd", "bwd_x_read_write")):
        vals = {p: r[yard] for p in ("fused", "fused-inplace") if (r := _path_row(doc, p)) and r.get(yard) is not None}
        if not vals:
            res[f"logits-{key}"] = ("no result", "missing")
            continue
        path = min(vals, key=vals.get)
        best[key] = vals[path]
        res[f"logits-{key}"] = (", ".join(f"{p} {v:.2f}x" for p, v in vals.items()),
                                "met" if vals[path] <= 1.3 else f"missed by {vals[path] / 1.3:.2f}x")
    gspo = doc.get("gspo") or {}
    ratio = gspo.get("ratio")
    res["gspo"] = ((f"{ratio:.2f}x ({gspo.get('kernel_ms', float('nan')):.3f} ms vs "
                    f"{gspo.get('trivial_ms', float('nan')):.3f} ms)", "met" if ratio <= 2 else f"missed by {ratio / 2:.2f}x")
                   if ratio is not None else ("no result", "missing"))
    return res


def verdict_hidden(out: str) -> dict:
    doc = _load(out, "hidden.json")
    row = doc and _path_row(doc, "hidden")
    if not row or row.get("tflops") is None:
        return {"hidden": ("no result", "missing")}
    tf, extra = row["tflops"], row["extra_gib"]
    ok_tf, ok_mem = tf >= 475, extra <= 0.65
    status = "met" if ok_tf and ok_mem else "missed: " + ", ".join(
        s for s, bad in ((f"speed at {tf / 475:.2f}x of the goal", not ok_tf), (f"memory {extra / 0.65:.2f}x the cap", not ok_mem)) if bad)
    err = row.get("max_rel_err")
    return {"hidden": (f"{tf:.0f} TF/s, {extra:.2f} GiB extra" + (f", max rel err {err:.1e}" if err is not None else ""),
                       status)}


def verdict_peers(out: str) -> dict:
    doc = _load(out, "peers.json")
    if not doc:
        return {}
    rows = [f"{r['path']} {r['tflops']:.0f} TF/s {r['extra_gib']:.2f} GiB" for r in doc.get("results", [])
            if r.get("tflops") is not None]
    return {"peers": ("; ".join(rows) or "no peer ran", "context")}


def verdict_run(kind: str, out: str) -> dict:
    """A trainer run's figures (tests/test_gpu_trainer.py writes them): RL tokens/s and the processes' peaks."""
    doc = _load(out, GOALS[kind][0])
    if not doc or doc.get("tokens_per_s") is None:
        return {kind: ("no result", "missing")}
    parts = [f"{doc['tokens_per_s']:.0f} RL tokens/s (median of {doc.get('steps', '?')} steps)"]
    for key, who in (("memory/trainer_peak_gib", "trainer"), ("memory/producer_peak_gib", "producer")):
        if doc.get(key) is not None:
            parts.append(f"{who} peak {doc[key]:.2f} GiB")
    return {kind: (", ".join(parts), "reported")}


VERDICTS = {"step": verdict_step, "logits": verdict_logits, "hidden": verdict_hidden, "peers": verdict_peers,
            "tiny": lambda out: verdict_run("tiny", out), "producer": lambda out: verdict_run("producer", out)}


def one_line(kind: str, out: str) -> str:
    parts = [f"{name}: {value} [{status}]" for name, (value, status) in VERDICTS[kind](out).items()]
    return "; ".join(parts)


def summary(out: str, budget: int, seconds: int, dry: bool) -> str:
    rows = {}
    tsv = os.path.join(out, "summary.tsv")
    if os.path.isfile(tsv):
        with open(tsv) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    rows[parts[0]] = {"stage": parts[0], "status": parts[1], "seconds": parts[2], "note": parts[3]}
    table = [rows.get(s, {"stage": s, "status": "SKIP", "seconds": "0", "note": "not reached"}) for s in STAGES]
    goals = {}
    for kind, fn in VERDICTS.items():
        try:
            goals.update(fn(out))
        except Exception as exc:  # a malformed JSON costs its verdict, never the table
            goals[kind] = (f"unreadable: {type(exc).__name__}: {exc}", "missing")
    counts = {k: sum(1 for r in table if r["status"].split(":")[0] == k) for k in ("PASS", "FAIL", "TIMEOUT", "SKIP")}
    lines = [f"gpu-check{' (dry mode: no CUDA here)' if dry else ''}: {seconds} s of a {budget} s budget; "
             + ", ".join(f"{v} {k}" for k, v in counts.items()),
             f"{'stage':10s} {'status':8s} {'s':>4s}  note"]
    for r in table:
        lines.append(f"{r['stage']:10s} {r['status']:8s} {r['seconds']:>4s}  {r['note']}")
    if any(status != "missing" for _, status in goals.values()):
        lines.append("")
        lines.append(f"{'goal':10s} {'verdict':24s} measured (goal)")
        for name, (value, status) in goals.items():
            lines.append(f"{name:10s} {status:24s} {value} ({GOALS.get(name, ('', '', 'context'))[2]})")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"seconds": seconds, "budget": budget, "dry": dry, "stages": table,
                   "goals": {k: {"measured": v, "verdict": s} for k, (v, s) in goals.items()}}, f, indent=1)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=[*VERDICTS, "summary"])
    p.add_argument("out")
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--dry", type=int, default=0)
    args = p.parse_args(argv)
    if args.kind == "summary":
        print(summary(args.out, args.budget, args.seconds, bool(args.dry)))
    else:
        print(one_line(args.kind, args.out))


if __name__ == "__main__":
    sys.exit(main())
