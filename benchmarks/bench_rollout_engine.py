#!/usr/bin/env python
"""The embedded HF rollout engine's peak extra memory and generation time at a real vocabulary, the step-wise
log-prob path (today's engine) beside the former stacked path, in one run (issue 29):

    python benchmarks/bench_rollout_engine.py                       # V = 151,936, 8 responses x 512 tokens
    python benchmarks/bench_rollout_engine.py --responses 4 --tokens 400 --paths new old

  new   HFRolloutEngine.generate: each step's log-prob of the sampled token from that step's [R, V] logits
        (megagspo/rollout/hf_engine.py, `_StepLogProbs`)
  old   the former generate, kept as the reference in tests/test_rollout_engine_memory.py
        (`_stacked_reference`): `output_logits` of every step, stacked to [R, T, V] fp32, log-softmax over V
  bare  transformers' `generate` alone, no log-probs (--paths bare): the floor both paths stand on

The model is a random Qwen3-MoE of tiny width (--hidden, 2 layers, 4 experts top-2) at --vocab, so the
vocabulary-sized tensors dominate as they do in a real rollout's extra memory; one prompt of 8 tokens, sampled
at temperature 1 (no early stop is forced: the number of tokens generated is printed). Each path runs in a
fresh subprocess, so its peak is its own: on the CPU, the peak resident set (VmHWM, reset through
/proc/self/clear_refs once the model exists and has generated 2 warm-up tokens) minus the resident set just
before the call; on CUDA (--device cuda), torch.cuda.max_memory_allocated minus the memory allocated before
(the model in --dtype; the engine's bf16-on-GPU path). "extra" therefore counts everything the call allocates
beyond the model: KV cache, activations and the log-prob path's tensors, and, on the CPU, heap the allocator
keeps: glibc raises its mmap threshold after the first freed [R, V] block (up to 32 MiB), so later step-sized
blocks come from the heap, which fragments as the KV cache grows and is not given back. Run with
MALLOC_MMAP_THRESHOLD_=131072 (a fixed threshold) to see the live tensors alone (slower: every block mmapped).
The acceptance line of issue 29: new < 1 GiB extra at V = 151,936, 8 x 512 (the old path: about 8 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Tok:
    pad_id, eos_id, bos_id = 0, 1, 2
    eos_ids = (1,)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _run_one(args) -> dict:
    """One path in this process: build, warm up, reset the peak, generate, report."""
    import torch

    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    if args.device == "cpu":
        os.environ["MEGAGSPO_DEVICE"] = "cpu"
    from moe.architecture import Qwen3MoeArchitecture
    from megagspo.rollout import HFRolloutEngine, RolloutOutput, SamplingParams
    from test_rollout_engine_memory import _stacked_reference

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    arch = Qwen3MoeArchitecture(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                                moe_intermediate_size=args.hidden, num_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=args.tokens + 16, intermediate_size=2 * args.hidden)
    engine = HFRolloutEngine(arch, _Tok(), record_routes=args.routes, dtype=args.dtype)
    prompt = [list(range(3, 11))]
    def bare(prompts, n, sampling):
        from transformers import GenerationConfig

        ids = torch.tensor(prompts * n, device=engine.device)
        seq = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=(
            GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=True, top_k=None,
                             pad_token_id=0, eos_token_id=[1])))
        mask = torch.ones(seq[:, len(prompts[0]):].shape, dtype=torch.bool)
        return RolloutOutput([], seq, mask, torch.zeros(mask.shape))

    call = {"new": engine.generate, "old": lambda *a: _stacked_reference(engine, *a), "bare": bare}[args.one]
    call(prompt, args.responses, SamplingParams(max_new_tokens=2))  # warm-up: thread pools, first touches
    sampling = SamplingParams(max_new_tokens=args.tokens)
    torch.manual_seed(1)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    out = call(prompt, args.responses, sampling)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024
    return {"path": args.one, "extra_bytes": peak - before, "seconds": seconds,
            "tokens": int(out.response_mask_RL.sum()), "device": str(engine.device),
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
            "logp_sum": float(out.logp_RL.sum())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--paths", nargs="+", default=["new", "old"], choices=["new", "old", "bare"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the policy's precision; the engine takes it on CUDA, stays fp32 on the CPU")
    parser.add_argument("--routes", action="store_true", help="record the routes too (R3, rl.old_policy.source=rollout)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the tiny model's ops are too small to split)")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one path, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(_run_one(args)))
        return 0
    rows = []
    print(f"V = {args.vocab:,}, {args.responses} responses x {args.tokens} tokens, hidden {args.hidden}, "
          f"{args.device}, policy {args.dtype}, routes {'recorded' if args.routes else 'not recorded'}")
    print(f"{'path':<5} {'extra GiB':>10} {'seconds':>9} {'tokens':>7} {'tokens/s':>9}  engine   logp sum")
    for path in args.paths:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", path] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "responses", "tokens", "hidden", "device", "dtype",
                                                  "threads")] + (["--routes"] if args.routes else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{path:<5} failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
            continue
        row = json.loads(line[len("RESULT "):])
        rows.append(row)
        print(f"{path:<5} {row['extra_bytes'] / 2**30:>10.3f} {row['seconds']:>9.2f} {row['tokens']:>7} "
              f"{row['tokens'] / row['seconds']:>9.1f}  {row['device']}/{row['dtype']}  {row['logp_sum']:.6f}")
    pair = [r for r in rows if r["path"] in ("new", "old")]
    if len(pair) == 2 and pair[0]["tokens"] == pair[1]["tokens"]:
        same = pair[0]["logp_sum"] == pair[1]["logp_sum"]
        print(f"same seed, same tokens: log-prob sums {'equal' if same else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("one", "json")}, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
