#!/usr/bin/env python
"""Grouped-query heads into torch's variable-length flash attention: the ways moe.cuda_calls.varlen_attn can
pass them, timed forward + backward on one packed stream, beside causal SDPA per sequence (the padded path).

    python benchmarks/bench_varlen_gqa.py                       # Qwen3-30B-A3B attention: 32 / 4 heads of 128
    python benchmarks/bench_varlen_gqa.py --tokens 32768 --json varlen.json

Modes: 'kwarg' (enable_gqa=True; only where the installed torch takes it, 2.13), 'grouped' (k / v with their G
heads, no keyword: what torch 2.11 gets), 'expand' (k / v repeated to N heads first). Lengths: log-uniform
128..4096 tokens (fixed seed) until --tokens. bf16, CUDA events, median of --repeats after one warm-up. Needs
CUDA (varlen flash attention has no CPU kernel): elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe import cuda_calls  # noqa: E402


def lengths_for(tokens: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < tokens:
        out.append(int(math.exp(math.log(128) + (math.log(4096) - math.log(128)) * torch.rand((), generator=gen))))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def time_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_varlen_gqa: needs CUDA (torch's varlen flash attention has no CPU kernel); nothing timed")
        return 0
    lengths = lengths_for(args.tokens, args.seed)
    T, N, G, D = sum(lengths), args.heads, args.kv_heads, args.head_dim
    cu_N1 = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q = torch.randn(T, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(T, N, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5

    def varlen(mode):
        return lambda: torch.autograd.backward(
            cuda_calls.varlen_attn(q, k, v, cu_N1, max(lengths), scale=scale, gqa_mode=mode), grad)

    def per_sequence():
        outs, start = [], 0
        for n in lengths:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                *(x[start:start + n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale,
                enable_gqa=True)[0].transpose(0, 1))
            start += n
        torch.autograd.backward(torch.cat(outs), grad)

    # causal attention FLOPs: fwd 2 matmuls of 2 L^2 N D / 2 each, bwd 2.5x fwd
    flops = 3.5 * sum(2 * 2 * n * n * N * D / 2 for n in lengths)
    modes = [m for m in cuda_calls.VARLEN_GQA_MODES
             if m != "kwarg" or cuda_calls.takes_keyword("torch.nn.attention.varlen.varlen_attn", "enable_gqa")]
    rows = {f"varlen {m}": time_ms(varlen(m), args.repeats) for m in modes}
    rows["SDPA per sequence"] = time_ms(per_sequence, args.repeats)
    base = rows[f"varlen {cuda_calls.varlen_gqa_mode()}"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {len(lengths)} sequences, {T} tokens, "
          f"{N} / {G} heads of {D}, bf16, fwd+bwd; detected mode {cuda_calls.varlen_gqa_mode()!r}")
    print(f"{'path':<20} {'ms':>8} {'TFLOP/s':>8} {'vs detected':>12}")
    for name, ms in rows.items():
        print(f"{name:<20} {ms:8.3f} {flops / ms / 1e9:8.1f} {ms / base:11.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": T,
                       "sequences": len(lengths), "detected": cuda_calls.varlen_gqa_mode(), "ms": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
