#!/usr/bin/env python
"""One training step of an N-layer Qwen3-MoE on one device, path against path: step time, tokens/s, model
TFLOP/s and peak memory.

    python benchmarks/bench_train_step.py                       # Qwen3-30B-A3B width, 4 layers, 2 x 4,096, bf16 (GPU)
    python benchmarks/bench_train_step.py --arch-file configs/models/qwen3_30b_a3b.yaml --layers 2
    python benchmarks/bench_train_step.py --device cpu --hidden 256 --experts 16 --topk 4 --moe-ffn 128 \\
        --heads 8 --kv-heads 2 --head-dim 32 --layers 2 --micro-batch 2 --seq 256 --dtype float32

Paths (moe.model.build_model's `implementation`, moe/implementation.py):
  sequential+local  Megatron's SequentialMLP (a Python loop over the experts) and DotProductAttention (the
                    local spec as Megatron ships it: the earlier default)
  grouped+sdpa      torch grouped_mm experts (moe.experts) and torch SDPA core attention (moe.attention): the
                    default on CPU and GPU
  te                Transformer Engine's layer spec (only where TE imports, on a GPU host)

A step is what the trainer runs: forward, next-token cross entropy, backward, Megatron's finalize_model_grads
and Megatron's distributed optimizer step (moe.optimizer: DDP with fp32 gradient buffers, fp32 master weights
for bf16). The embedding and LM head are in the step; the vocabulary is small (--vocab) because the model
step, not the head, is measured. Each path runs in a fresh subprocess, so its peak memory is its own: on CUDA
torch.cuda.max_memory_allocated, on CPU the process's peak resident set (VmHWM). "saved" is what autograd
keeps from one forward for backward (parameters left out): the step's activation memory, exact on any device.

Model FLOPs per step = 3 x forward FLOPs (backward = 2 x forward), recompute not counted; forward FLOPs per
token, summed over layers:
  attention projections  2 h (nq + 2 nkv) d  +  2 nq d h
  core attention         2 x 2 nq d S, causal, counted at half: 2 nq d S
  router                 2 h E
  experts                k x (2 h 2I + 2 I h) = 6 k h I
  plus the LM head       2 h V  (once, not per layer)
with h hidden, nq / nkv query / key-value heads, d head dim, S sequence length, E experts, k top-k, I expert
FFN width, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PATHS = {"sequential+local": dict(experts="sequential", attention="local"),
         "grouped+sdpa": dict(experts="grouped", attention="sdpa"),
         "te": None}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch-file", default="", help="HF config.json / folder / YAML of the architecture (width "
                   "from it; --layers and --vocab still apply); default: the flags below (Qwen3-30B-A3B)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--moe-ffn", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--paths", default="sequential+local,grouped+sdpa,te",
                   help="comma-separated; te is skipped (and said so) where Transformer Engine does not import")
    p.add_argument("--one-path", default="", help=argparse.SUPPRESS)  # the child process's path
    args = p.parse_args(argv)
    for name in args.paths.split(","):
        if name not in PATHS:
            p.error(f"--paths: unknown path {name!r}; valid: {', '.join(PATHS)}")
    for name in ("layers", "micro_batch", "seq", "steps", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def architecture(args):
    from moe.architecture import Qwen3MoeArchitecture

    if args.arch_file:
        import dataclasses

        from moe.hf_config import architecture_from_hf_config

        arch = architecture_from_hf_config(args.arch_file)
        return dataclasses.replace(arch, num_hidden_layers=args.layers, vocab_size=args.vocab, mlp_only_layers=(),
                                   max_position_embeddings=max(args.seq, 2))
    return Qwen3MoeArchitecture(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                head_dim=args.head_dim, moe_intermediate_size=args.moe_ffn,
                                num_experts=args.experts, num_experts_per_tok=args.topk,
                                max_position_embeddings=max(args.seq, 2))


def model_flops_per_step(arch, batch: int, seq: int) -> float:
    """3 x forward FLOPs of one step (formula in the module docstring)."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    per_token_layer = (2 * h * (nq + 2 * nkv) * d + 2 * nq * d * h      # projections
                       + 2 * nq * d * seq                                # causal core attention at half
                       + 2 * h * arch.num_experts                       # router
                       + 6 * arch.num_experts_per_tok * h * arch.moe_intermediate_size)  # experts
    per_token = arch.num_hidden_layers * per_token_layer + 2 * h * arch.vocab_size
    return 3.0 * per_token * batch * seq


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not in /proc/self/status")


def saved_for_backward_bytes(model, forward) -> int:
    """Bytes autograd keeps from one forward for its backward, parameters left out (each storage once): the
    activation memory of the step, independent of the allocator (the CPU's peak RSS is not)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def run_one_path(args) -> dict:
    """Build, warm up and time one path in this process; the result as a dict (printed as JSON)."""
    if args.device == "cpu":
        os.environ["MEGAGSPO_DEVICE"] = "cpu"
    import torch

    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.implementation import ModelImplementation
    from moe.model import build_model, forward_logits, transformer_engine_available
    from moe.optimizer import (OptimizerSettings, build_optimizer, finish_gradients, optimizer_step,
                               params_dtype, wrap_data_parallel, zero_gradients)
    from moe.parallel import ParallelLayout, init_distributed, initialize_model_parallel

    if args.one_path == "te" and not (args.device == "cuda" and transformer_engine_available()):
        return {"path": "te", "skipped": "Transformer Engine does not import here (or --device cpu)"}
    apply_cpu_shim()
    init_distributed()
    initialize_model_parallel(ParallelLayout())
    if args.device == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        initialize_cpu_rng(1234)
    arch = architecture(args)
    choice = PATHS[args.one_path]
    implementation = ModelImplementation(recompute=args.recompute, **(choice or {}))
    model = build_model(arch, params_dtype=params_dtype(DTYPES[args.dtype]), implementation=implementation,
                        use_transformer_engine=choice is None)
    ddp = wrap_data_parallel(model)
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=1e-5))
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, arch.vocab_size, (args.micro_batch, args.seq + 1), generator=gen).to(device)

    def step():
        zero_gradients(ddp, optimizer)
        logits_BSV = forward_logits(model, tokens_BS[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits_BSV.float().flatten(0, 1), tokens_BS[:, 1:].flatten())
        loss.backward()
        finish_gradients(ddp)
        optimizer_step(optimizer)
        return loss

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    peak = _peak_bytes(device)
    saved = saved_for_backward_bytes(model, lambda: forward_logits(model, tokens_BS[:, :-1]))
    tokens = args.micro_batch * args.seq
    return {"path": args.one_path, "step_s": seconds, "tokens_per_s": tokens / seconds,
            "model_tflops": model_flops_per_step(arch, args.micro_batch, args.seq) / seconds / 1e12,
            "peak_gib": peak / 2**30, "saved_gib": saved / 2**30, "loss": float(loss),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one_path:
        print("RESULT " + json.dumps(run_one_path(args)), flush=True)
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    results = []
    for name in args.paths.split(","):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--one-path", name],
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            results.append({"path": name, "failed": proc.stderr.strip().splitlines()[-1:] or ["no output"]})
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
    import torch

    arch = architecture(args)
    print(f"train step: {args.layers} layers, hidden {arch.hidden_size}, {arch.num_experts} experts top-"
          f"{arch.num_experts_per_tok}, expert FFN {arch.moe_intermediate_size}, heads {arch.num_attention_heads}/"
          f"{arch.num_key_value_heads} x {arch.head_dim}, vocab {arch.vocab_size}; micro-batch {args.micro_batch} x "
          f"seq {args.seq} = {args.micro_batch * args.seq} tokens; {args.dtype}; recompute {args.recompute}; "
          f"median of {args.steps} after {args.warmup} warm-up; load average {os.getloadavg()[0]:.1f}; "
          f"torch {torch.__version__}")
    print(f"model FLOPs per step (3 x forward, causal attention at half): "
          f"{model_flops_per_step(arch, args.micro_batch, args.seq) / 1e12:.4g} TFLOP")
    print(f"{'path':18s} {'step s':>9s} {'tokens/s':>10s} {'TFLOP/s':>9s} {'peak GiB':>9s} {'saved GiB':>9s} "
          f"{'loss':>8s}  device")
    base = next((r for r in results if "step_s" in r), None)
    for r in results:
        if "step_s" not in r:
            print(f"{r['path']:18s} {'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + ' '.join(r['failed'])}")
            continue
        print(f"{r['path']:18s} {r['step_s']:9.4f} {r['tokens_per_s']:10.1f} {r['model_tflops']:9.3g} "
              f"{r['peak_gib']:9.3f} {r['saved_gib']:9.3f} {r['loss']:8.4f}  {r['device']}")
    for r in results:
        if "step_s" in r and r is not base:
            print(f"{r['path']} vs {base['path']}: {base['step_s'] / r['step_s']:.2f}x faster, peak memory "
                  f"{r['peak_gib'] / base['peak_gib']:.2f}x, saved for backward {r['saved_gib'] / base['saved_gib']:.2f}x")
    if any("failed" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
