#!/usr/bin/env python
"""Packed against padded RL step on a realistic spread of lengths: tokens per second of pi_old's recompute and of
the update (forward + backward + optimizer steps of every mini-batch), and the process's peak memory.

    python benchmarks/bench_packing.py                        # CPU, the tiny recipe's model, 64 sequences
    python benchmarks/bench_packing.py --json packing.json --rows 128 --hidden 256
    python benchmarks/bench_packing.py --rows 128 --resp-max 1024 --hidden 512 --extra model.precision=bf16   # GPU

One synthetic rollout batch (fixed seed, the same for every mode): prompts of uniform 16-64 tokens, responses
log-uniform 16-512 tokens (RL responses range from a few dozen to hundreds of tokens), random token ids,
random advantages, engine log-probs. It goes through megagspo.rl.step's own stages — `prepare`,
`old_policy` (a Megatron no-grad recompute of pi_old) and `update` (rl.batch.mini_batches optimizer steps) — in each
mode, each mode in a fresh subprocess so its peak resident memory (VmHWM) is its own:
  padded        rl.batch.packing=false: rows right-padded to the longest sequence of the batch
  packed        rl.batch.packing=true: each micro-batch one stream of whole sequences
  packed+budget rl.batch.packing=true, rl.batch.max_tokens_per_micro_batch=--budget
Tokens per second count REAL tokens (prompt + response positions), the same numerator for every mode, so the
ratio is the speed-up on the same work. --steps timed repetitions after one warm-up; medians reported. The device
is the trainer's (CUDA where available, MEGAGSPO_DEVICE to choose); on CUDA each stage is timed between
synchronizations and the peak allocated GPU memory is reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"padded": ["rl.batch.packing=false"], "packed": ["rl.batch.packing=true"],
         "packed+budget": ["rl.batch.packing=true", "rl.batch.max_tokens_per_micro_batch={budget}"]}


def _synthetic_batch(args, vocab_size, pad_id):
    import torch

    from megagspo.rollout.base import RolloutOutput

    gen = torch.Generator().manual_seed(args.seed)
    rows = args.rows
    prompt_len = torch.randint(args.prompt_min, args.prompt_max + 1, (rows,), generator=gen)
    log_lo, log_hi = math.log(args.resp_min), math.log(args.resp_max)
    resp_len = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(rows, generator=gen)).round().long()
    width = int(resp_len.max())
    low = 3  # keep clear of the tokenizer's special ids
    prompts = [torch.randint(low, vocab_size, (int(n),), generator=gen).tolist() for n in prompt_len]
    response = torch.randint(low, vocab_size, (rows, width), generator=gen)
    mask = torch.arange(width)[None] < resp_len[:, None]
    response = torch.where(mask, response, torch.full_like(response, pad_id))
    logp = torch.where(mask, -torch.rand(rows, width, generator=gen) * 3, 0.0)
    advantages = torch.randn(rows, generator=gen)
    real = int((prompt_len + resp_len - 1).sum())
    return RolloutOutput(prompts, response, mask, logp), advantages, real


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_mode(args, mode: str) -> dict:
    """In this process: build the trainer for `mode`, time the stages on the synthetic batch."""
    import torch

    from megagspo.config import load_config
    from megagspo.rl.batch_maker import Rollouts, Scores
    from megagspo.trainer.trainer import Trainer

    overrides = [
        f"threads={args.threads}", "sft.steps=0", "rl.eval.samples=0", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", "log.save_checkpoint=false", "checkpoint.every_steps=0", "data.train_size=64",
        "data.eval_size=4", f"data.max_prompt_tokens={args.prompt_max}", f"data.max_response_tokens={args.resp_max}",
        f"model.hidden_size={args.hidden}", f"model.num_hidden_layers={args.layers}",
        f"model.moe_intermediate_size={args.hidden}", f"model.max_position_embeddings={args.prompt_max + args.resp_max + 8}",
        f"rl.batch.prompts_per_step={args.rows // 4}", "rl.batch.group_size=4", f"rl.batch.mini_batches={args.mini_batches}",
        f"rl.batch.micro_batch_size={args.micro_batch_size if mode != 'packed+budget' else 0}", "rl.optim.lr=1e-5",
        f"log.out_dir={args.out_dir}", f"name=bench_{mode.replace('+', '_')}",
        *(o.format(budget=args.budget) for o in MODES[mode]), *args.extra]
    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), overrides)
    trainer = Trainer(cfg, quiet=True)
    optimizer = trainer.make_rl_optimizer()
    step = trainer.step
    out, advantages, real = _synthetic_batch(args, trainer.arch.vocab_size, trainer.tokenizer.pad_id)
    rollouts, scores = Rollouts([], out), Scores(torch.zeros(args.rows), advantages, None)
    times = {"old_policy": [], "update": []}
    computed = 0
    sync = torch.cuda.synchronize if trainer.policy.device.type == "cuda" else (lambda: None)
    for rep in range(args.steps + 1):
        batch = step.prepare(rollouts, scores)
        sync()
        t0 = time.perf_counter()
        step.old_policy(batch)
        sync()
        t1 = time.perf_counter()
        step.update(batch, rep, optimizer)
        sync()
        t2 = time.perf_counter()
        if rep:  # the first repetition warms up
            times["old_policy"].append(t1 - t0)
            times["update"].append(t2 - t1)
        computed = sum(mb.view.computed_tokens for mb in batch.micro_batches)
    med = {k: statistics.median(v) for k, v in times.items()}
    cuda = trainer.policy.device.type == "cuda"
    return {"mode": mode, "device": str(trainer.policy.device), "real_tokens": real, "computed_tokens": computed,
            "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "old_policy_s": med["old_policy"], "update_s": med["update"],
            "old_policy_tokens_per_s": real / med["old_policy"], "update_tokens_per_s": real / med["update"],
            "peak_rss_mib": _vm_hwm_mib()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64, help="sequences in the rollout batch (a multiple of 4)")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=64)
    p.add_argument("--resp-min", type=int, default=16)
    p.add_argument("--resp-max", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch (padded / packed)")
    p.add_argument("--budget", type=int, default=1024, help="packed+budget: rl.batch.max_tokens_per_micro_batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="padded,packed,packed+budget")
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides, e.g. model.precision=bf16")
    p.add_argument("--json", default=None)
    p.add_argument("--out-dir", default=None, help="run folders (default: a fresh temporary folder)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one mode, print JSON
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_mode(args, args.one)))
        return
    results = []
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="megagspo_bench_packing_")
    for mode in args.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--out-dir", out_dir, "--one", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[0][len("RESULT "):]))
    base = results[0]
    print(f"{args.rows} sequences: prompts {args.prompt_min}-{args.prompt_max}, responses log-uniform "
          f"{args.resp_min}-{args.resp_max}; {base['real_tokens']} real tokens; hidden {args.hidden}, "
          f"{args.layers} layers; {args.threads} thread(s); median of {args.steps}")
    print(f"device {base['device']}; {' '.join(args.extra) or 'recipe defaults'}")
    print(f"{'mode':<14} {'computed':>9} {'pi_old tok/s':>13} {'x':>6} {'update tok/s':>13} {'x':>6} {'peak RSS MiB':>13}"
          f" {'peak CUDA GiB':>14}")
    for r in results:
        cuda = "-" if r["peak_cuda_gib"] is None else f"{r['peak_cuda_gib']:.2f}"
        print(f"{r['mode']:<14} {r['computed_tokens']:>9} {r['old_policy_tokens_per_s']:>13.0f} "
              f"{r['old_policy_tokens_per_s'] / base['old_policy_tokens_per_s']:>6.2f} "
              f"{r['update_tokens_per_s']:>13.0f} {r['update_tokens_per_s'] / base['update_tokens_per_s']:>6.2f} "
              f"{r['peak_rss_mib']:>13.0f} {cuda:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
