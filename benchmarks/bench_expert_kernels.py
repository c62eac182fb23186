#!/usr/bin/env python
"""The grouped experts' two Triton kernels against the torch ops they replace, alone, at Qwen3-30B-A3B expert
shapes (one MoE layer of one micro-batch: 128 experts, hidden 2048, expert FFN 768, 2 x 4,096 tokens x top-8 =
65,536 routed rows, bf16), with the error of each against fp32 math:

  wgrad   fc1 and fc2 weight gradients into fp32 main_grad laid out as Megatron DDP lays it out (one buffer,
          expert e's fc1 and fc2 at base + e S, moe.experts): `add` (torch grouped_mm to a bf16 [E, N, K]
          gradient + one add into the strided fp32 view, the default) against moe.triton_wgrad with up to four
          tile configurations (--tiles; the first is the kernel's default). No autotuning in the kernel itself:
          it accumulates in place, so this script is how a tile choice is measured.
  swiglu  SwiGLU x routing probability forward and forward + backward: the unfused torch ops of Megatron's MLP
          against moe.triton_swiglu's pair.

    python benchmarks/bench_expert_kernels.py --json kernels.json               # GPU, ~20 s
    TRITON_INTERPRET=1 python benchmarks/bench_expert_kernels.py --device cpu --experts 4 --hidden 32 \\
        --moe-ffn 16 --rows 40 --repeats 1 --tiles 16,16,16,4,2               # the CPU interpreter (a smoke run)

Times: CUDA events around each call, median of --repeats after one warm-up call (wall clock on the CPU).
Routed rows per expert: a multinomial draw over a softmax of N(0, 0.5) logits (uneven, as routers are), seeded.
Errors: max |x - fp32 reference| / max |fp32 reference|, the reference computed for experts 0..3 (wgrad: the
fp32 product of the bf16 operands; swiglu: the torch ops in fp64 on the same inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from moe import cuda_calls  # noqa: E402
from moe.triton_support import triton_problem  # noqa: E402
from moe.triton_swiglu import SwigluProbs, swiglu_probs_reference  # noqa: E402
from moe.triton_wgrad import DEFAULT_TILES, WgradTiles, grouped_wgrad_accumulate  # noqa: E402

TILE_CANDIDATES = "128,128,64,8,3;128,64,64,4,3;64,128,64,4,3;128,128,32,8,4"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-ffn", type=int, default=768)
    p.add_argument("--rows", type=int, default=65536, help="routed rows (tokens x top-k) of one micro-batch")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiles", default=TILE_CANDIDATES,
                   help="';'-separated wgrad tile configurations block_n,block_k,block_t,num_warps,num_stages (<= 4)")
    p.add_argument("--json", default="", metavar="FILE")
    args = p.parse_args(argv)
    args.tile_list = [WgradTiles(*(int(v) for v in t.split(","))) for t in args.tiles.split(";") if t.strip()]
    if not 1 <= len(args.tile_list) <= 4:
        p.error("--tiles: one to four configurations")
    return args


def timed(fn, repeats: int, device) -> float:
    """Median milliseconds of fn() over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def bench_wgrad(args, device, counts, gen) -> dict:
    e, h, i = args.experts, args.hidden, args.moe_ffn
    rows = sum(counts)
    offs_E = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    fc1, fc2 = 2 * i * h, h * i
    stride = fc1 + fc2  # DDP's buffer: expert e's fc1 then fc2 at base + e S (both multiples of 64 here)
    buffer = torch.zeros(e * stride, dtype=torch.float32, device=device)
    out = {}
    for name, n, k, base in (("fc1", 2 * i, h, 0), ("fc2", h, i, fc1)):
        dy_TN = torch.randn(rows, n, generator=gen).to(device, torch.bfloat16)
        x_TK = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
        main_ENK = buffer[base:].as_strided((e, n, k), (stride, k, 1))
        ends = torch.tensor(counts).cumsum(0).tolist()
        ref = [dy_TN[end - c:end].float().t() @ x_TK[end - c:end].float() for c, end in zip(counts[:4], ends[:4])]

        def add():
            main_ENK.add_(cuda_calls.grouped_mm(dy_TN.t(), x_TK, offs_E))

        result = {"n": n, "k": k}
        for label, run in [("add", add)] + [(f"triton {t.block_n}x{t.block_k}x{t.block_t} w{t.num_warps} "
                                             f"s{t.num_stages}", lambda t=t: grouped_wgrad_accumulate(
                                                 main_ENK, dy_TN, x_TK, offs_E, t)) for t in args.tile_list]:
            buffer.zero_()
            run()
            err = max(rel_err(main_ENK[ex], r) for ex, r in enumerate(ref))
            result[label] = {"ms": timed(run, args.repeats, device), "rel_err": err}
        out[name] = result
    return out


def bench_swiglu(args, device, rows, gen) -> dict:
    i = args.moe_ffn
    fc1_TF = (3 * torch.randn(rows, 2 * i, generator=gen)).to(device, torch.bfloat16)
    probs_T = torch.rand(rows, generator=gen).to(device)
    dout_TI = torch.randn(rows, i, generator=gen).to(device, torch.bfloat16)
    ref = swiglu_probs_reference(fc1_TF[:256].double(), probs_T[:256].double())
    out = {}
    for label, fused in (("torch", False), ("fused", True)):
        def forward(fused=fused):
            f = fc1_TF.detach().requires_grad_(True)
            p = probs_T.detach().requires_grad_(True)
            return (SwigluProbs.apply(f, p, True) if fused else swiglu_probs_reference(f, p)), f, p

        def forward_backward(forward=forward):
            act, _, _ = forward()
            act.backward(dout_TI)

        with torch.no_grad():
            fwd_ms = timed(lambda: forward()[0], args.repeats, device)
        out[label] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": timed(forward_backward, args.repeats, device),
                      "rel_err": rel_err(forward()[0][:256].detach(), ref)}
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    problem = triton_problem(device)
    if problem:
        sys.exit(f"bench_expert_kernels: the Triton kernels cannot run here: {problem}")
    gen = torch.Generator().manual_seed(0)
    weights = torch.softmax(0.5 * torch.randn(args.experts, generator=gen), 0)
    counts = torch.bincount(torch.multinomial(weights, args.rows, replacement=True, generator=gen),
                            minlength=args.experts).tolist()
    facts = {"experts": args.experts, "hidden": args.hidden, "moe_ffn": args.moe_ffn, "rows": args.rows,
             "rows_per_expert": {"min": min(counts), "max": max(counts)}, "device": args.device,
             "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
             "torch": torch.__version__, "default_tiles": DEFAULT_TILES.__dict__}
    facts["wgrad"] = bench_wgrad(args, device, counts, gen)
    facts["swiglu"] = bench_swiglu(args, device, args.rows, gen)
    print(f"expert kernels: E={args.experts} hidden {args.hidden} FFN {args.moe_ffn}, {args.rows} routed rows "
          f"({min(counts)}..{max(counts)} per expert), bf16, {facts['gpu'] or 'cpu'}, median of {args.repeats}")
    for name, result in facts["wgrad"].items():
        for label, r in result.items():
            if isinstance(r, dict):
                print(f"wgrad {name} [{result['n']}x{result['k']}] {label:28s} {r['ms']:8.3f} ms  "
                      f"rel err {r['rel_err']:.2e}")
    for label, r in facts["swiglu"].items():
        print(f"swiglu x probs {label:6s} fwd {r['fwd_ms']:7.3f} ms  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms  "
              f"rel err {r['rel_err']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1)
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
