#!/usr/bin/env python
"""Training steps of an N-layer Qwen3-MoE on one device, path against path: forward+backward time per
micro-batch and its model TFLOP/s, the optimizer's time per step, whole-step TFLOP/s, peak memory; optionally
a profile (top kernels, device time outside matmuls and attention) and a JSON file of everything.

    python benchmarks/bench_train_step.py                       # Qwen3-30B-A3B width, 4 layers, 2 x 4,096, bf16 (GPU)
    python benchmarks/bench_train_step.py --json step.json --profile prof/     # + JSON + profile of grouped+sdpa
    python benchmarks/bench_train_step.py --arch-file configs/models/qwen3_30b_a3b.yaml --layers 2
    python benchmarks/bench_train_step.py --device cpu --hidden 256 --experts 16 --topk 4 --moe-ffn 128 \\
        --heads 8 --kv-heads 2 --head-dim 32 --layers 2 --micro-batch 2 --seq 256 --dtype float32

Paths (moe.model.build_model's `implementation`, moe/implementation.py; --paths, default grouped+sdpa):
  sequential+local  Megatron's SequentialMLP (a Python loop over the experts) and DotProductAttention (the
                    local spec as Megatron ships it: the earlier default; ~40 s per run on a GPU, not a goal)
  grouped+sdpa      torch grouped_mm experts (moe.experts) and torch SDPA core attention (moe.attention), the
                    fast token dispatcher (moe.token_dispatch) and, on CUDA, the experts' weight gradients
                    accumulated into the fp32 main_grad inside per-expert cuBLAS GEMMs: the default on CPU and GPU
  grouped+sdpa+megatron-dispatch   the same with Megatron's MoEAlltoAllTokenDispatcher as it is
  grouped+sdpa+wgrad-add           the same with the weight gradients from one grouped GEMM added by one
                                   [E, N, K] add (the CPU's path)
  grouped+sdpa+wgrad-foreach       ... added by torch's multi-tensor add
  grouped+sdpa+wgrad-triton        ... by one grouped Triton GEMM per linear that adds its fp32 tiles into main_grad
                                   (moe.triton_wgrad; CUDA with Triton only)
  grouped+sdpa+swiglu-fused        the default with SwiGLU x routing probability in one Triton kernel each way
                                   (moe.triton_swiglu; on the CPU its torch reference)
  grouped+sdpa+triton              both Triton kernels
  A path whose Triton kernels cannot run here (no triton, or wgrad-triton on the CPU) fails with the reason.
  te                Transformer Engine's layer spec (only where TE imports, on a GPU host)

One optimizer step is what the trainer runs: --micro-batches k forward+backward passes (each --micro-batch x
--seq tokens, its own random tokens; next-token cross entropy / k), Megatron DDP's hooks accumulating every
pass into the fp32 `main_grad` buffers, then Megatron's finalize_model_grads and the distributed optimizer step
(moe.optimizer: fp32 master weights for bf16, global-norm clipping, AdamW, master -> parameter copy), then the
gradient buffers are zeroed for the next step. Two parts are timed separately (host clock around
torch.cuda.synchronize on CUDA; one sync after the k passes, none between them):
  fwd+bwd    the k forward+backward passes                        -> seconds per micro-batch, model TFLOP/s
  optimizer  finalize_model_grads + optimizer step + grad zeroing  -> seconds per optimizer step
Step = both. The optimizer's share of a step at k = 8 is computed from the two: opt / (8 x fwdbwd_per_mb + opt).
--warmup and --steps count optimizer steps; each figure is the median over the timed steps. The embedding and
LM head are in the step; the vocabulary is small (--vocab) because the model, not the head, is measured. Each
path runs in a fresh subprocess, so its peak memory is its own: on CUDA torch.cuda.max_memory_allocated, on
CPU the process's peak resident set (VmHWM). "saved" is what autograd keeps from one forward for backward
(parameters left out): one micro-batch's activation memory, exact on any device.

Model FLOPs per micro-batch = 3 x forward FLOPs (backward = 2 x forward), recompute not counted; forward FLOPs
per token, summed over layers:
  attention projections  2 h (nq + 2 nkv) d  +  2 nq d h
  core attention         2 x 2 nq d S, causal, counted at half: 2 nq d S
  router                 2 h E
  experts                k x (2 h 2I + 2 I h) = 6 k h I
  plus the LM head       2 h V  (once, not per layer)
with h hidden, nq / nkv query / key-value heads, d head dim, S sequence length, E experts, k top-k, I expert
FFN width, V vocabulary.

--profile DIR (the grouped+sdpa path only): after the timed steps, one more optimizer step (k micro-batches)
runs under torch.profiler (CPU + CUDA activities on CUDA, CPU only on the CPU); the chrome trace goes to
DIR/trace_grouped_sdpa.json.gz (gzip; dropped, and said so, when the gzip is over 20 MB), the table to
DIR/profile_grouped_sdpa.txt and into the JSON. On CUDA the table ranks kernels (every device event: kernels,
memcpy, memset; GPU user-annotation ranges, recognised by their activity type or by bearing a CPU event's name,
left out) by device time summed per name; on the CPU it ranks operators by self CPU time. Each name is put in
one class, by its lower-cased name, first rule that matches:
  attention  contains flash, fmha, attention, attn or sdpa
  matmul     contains gemm, gemv, cutlass, cublas, matmul, nvjet, xmma, wgmma or grouped_mm, or has mm, bmm,
             addmm, baddbmm, addbmm, mv or dot as a whole word (words split at anything but a-z and 0-9)
  other      everything else (elementwise, reductions, permutation, optimizer, copies, memset/memcpy, ...)
and the shares of the total time per class are reported ("outside matmul and attention" = other). The shares
of device time inside the fwd+bwd and optimizer parts (split at the synchronize between them) and the device
busy share (device time / the profiled step's wall time; below 1 means the device waited for the host)
are reported too.

Output: a header, a table (whitespace-separated; column 4 is the fwd+bwd model TFLOP/s), then per path
  <path> fwd+bwd: X ms/micro-batch, Y TFLOP/s; optimizer: Z ms/step (share at k=8: P%); step: S ms, W TFLOP/s at k=K; peak M GiB
and, with --profile, the profile table. --json FILE writes the header facts and, under "results", every path's
dict (fwd_bwd_ms_per_micro_batch, fwd_bwd_tflops, optimizer_ms, optimizer_share_k8, step_ms, step_tflops,
peak_gib, ...; a path that did not run has "skipped" or "failed" instead).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PATHS = {"sequential+local": dict(experts="sequential", attention="local", dispatcher="megatron"),
         "grouped+sdpa": dict(experts="grouped", attention="sdpa"),
         "grouped+sdpa+megatron-dispatch": dict(experts="grouped", attention="sdpa", dispatcher="megatron"),
         "grouped+sdpa+wgrad-add": dict(experts="grouped", attention="sdpa", expert_wgrad="add"),
         "grouped+sdpa+wgrad-foreach": dict(experts="grouped", attention="sdpa", expert_wgrad="foreach"),
         "grouped+sdpa+wgrad-triton": dict(experts="grouped", attention="sdpa", expert_wgrad="triton"),
         "grouped+sdpa+swiglu-fused": dict(experts="grouped", attention="sdpa", expert_activation="fused"),
         "grouped+sdpa+triton": dict(experts="grouped", attention="sdpa", expert_wgrad="triton",
                                     expert_activation="fused"),
         "te": None}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
PROFILED_PATH = "grouped+sdpa"
TRACE_LIMIT_BYTES = 20 * 10**6
SHARE_AT_K = 8


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
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward+backward pass")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, default=4,
                   help="forward+backward passes accumulated per optimizer step (k)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps (medians are reported)")
    p.add_argument("--paths", default="grouped+sdpa",
                   help="comma-separated, of: " + ", ".join(PATHS) + "; te is skipped (and said so) where "
                   "Transformer Engine does not import")
    p.add_argument("--json", default="", metavar="FILE", help="write the header facts and every path's results")
    p.add_argument("--profile", default="", metavar="DIR",
                   help=f"profile one more optimizer step of {PROFILED_PATH} into DIR (trace + table)")
    p.add_argument("--one-path", default="", help=argparse.SUPPRESS)  # the child process's path
    args = p.parse_args(argv)
    for name in args.paths.split(","):
        if name not in PATHS:
            p.error(f"--paths: unknown path {name!r}; valid: {', '.join(PATHS)}")
    for name in ("layers", "micro_batch", "seq", "steps", "vocab", "micro_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
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
    """3 x forward FLOPs of one forward+backward pass of batch x seq tokens (formula in the module docstring)."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    per_token_layer = (2 * h * (nq + 2 * nkv) * d + 2 * nq * d * h      # projections
                       + 2 * nq * d * seq                                # causal core attention at half
                       + 2 * h * arch.num_experts                       # router
                       + 6 * arch.num_experts_per_tok * h * arch.moe_intermediate_size)  # experts
    per_token = arch.num_hidden_layers * per_token_layer + 2 * h * arch.vocab_size
    return 3.0 * per_token * batch * seq


def optimizer_share(fwdbwd_per_mb_s: float, opt_s: float, k: int = SHARE_AT_K) -> float:
    """The optimizer's share of an optimizer step of k micro-batches: opt / (k x fwdbwd_per_mb + opt)."""
    return opt_s / (k * fwdbwd_per_mb_s + opt_s)


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


# ---------------------------------------------------------------------------------------------------- profile

_ATTENTION_SUBSTRINGS = ("flash", "fmha", "attention", "attn", "sdpa")
_MATMUL_SUBSTRINGS = ("gemm", "gemv", "cutlass", "cublas", "matmul", "nvjet", "xmma", "wgmma", "grouped_mm")
_MATMUL_WORDS = frozenset(("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot"))


def classify_kernel(name: str) -> str:
    """'attention', 'matmul' or 'other' by the rules in the module docstring (first match wins)."""
    low = name.lower()
    if any(s in low for s in _ATTENTION_SUBSTRINGS):
        return "attention"
    if any(s in low for s in _MATMUL_SUBSTRINGS) or not _MATMUL_WORDS.isdisjoint(re.split(r"[^a-z0-9]+", low)):
        return "matmul"
    return "other"


_ANNOTATIONS = ("bench::fwd_bwd", "bench::optimizer")


def summarize_profile(events, on_device: bool, top: int = 10) -> dict:
    """Top kernels (device events, on CUDA) or operators (self CPU time, on the CPU) of one profiled step,
    the class shares, and the device time per phase. `events`: torch.profiler's FunctionEvent list."""
    from torch.autograd import DeviceType

    opt_start = next((e.time_range.start for e in events
                      if e.name == "bench::optimizer" and e.device_type == DeviceType.CPU), None)
    step = [e for e in events if e.name in _ANNOTATIONS and e.device_type == DeviceType.CPU]
    wall_us = (max(e.time_range.end for e in step) - min(e.time_range.start for e in step)) if step else 0.0
    per_name: dict[str, list] = {}
    phase_us = {"fwd_bwd": 0.0, "optimizer": 0.0}
    total = 0.0
    # a GPU user-annotation range (record_function seen on the device: ours, torch's "Optimizer.step#...") has
    # the name of its CPU range: device events named like a CPU event are left out, not counted twice
    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    for e in events:
        if on_device:
            if e.device_type == DeviceType.CPU or getattr(e, "is_user_annotation", False) or e.name in cpu_names \
                    or "annotation" in str(getattr(e, "activity_type", "") or "").lower():
                continue
            us = float(e.time_range.end - e.time_range.start)
            if opt_start is not None:
                phase_us["optimizer" if e.time_range.start >= opt_start else "fwd_bwd"] += us
        else:
            if e.device_type != DeviceType.CPU or e.is_async or getattr(e, "is_user_annotation", False) \
                    or e.name in _ANNOTATIONS:
                continue
            us = float(e.self_cpu_time_total)
        if us <= 0:
            continue
        total += us
        entry = per_name.setdefault(e.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    class_us = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, (us, _) in per_name.items():
        class_us[classify_kernel(name)] += us
    ranked = sorted(per_name.items(), key=lambda item: -item[1][0])[:top]
    share = (lambda us: us / total) if total > 0 else (lambda us: 0.0)
    out = {
        "time_kind": "device time of kernels / memcpy / memset" if on_device else "self CPU time of operators",
        "total_ms": total / 1e3,
        "wall_ms": wall_us / 1e3,
        "top": [{"name": name[:300], "class": classify_kernel(name), "ms": us / 1e3, "share": share(us),
                 "calls": calls} for name, (us, calls) in ranked],
        "class_share": {cls: share(us) for cls, us in class_us.items()},
        "share_outside_matmul_attention": share(class_us["other"]),
    }
    if on_device:
        out["device_busy_share"] = total / wall_us if wall_us > 0 else 0.0
        out["phase_ms"] = {phase: us / 1e3 for phase, us in phase_us.items()}
    return out


def format_profile(path: str, prof: dict) -> str:
    if "error" in prof:
        return f"{path} profile: FAILED: {prof['error']}"
    lines = [f"{path} profile (one optimizer step; {prof['time_kind']}): total {prof['total_ms']:.2f} ms over a "
             f"{prof['wall_ms']:.2f} ms step" + (f", device busy {100 * prof['device_busy_share']:.1f}%"
                                                 if "device_busy_share" in prof else "")]
    if "phase_ms" in prof:
        lines.append(f"  device time: fwd+bwd {prof['phase_ms']['fwd_bwd']:.2f} ms, optimizer "
                     f"{prof['phase_ms']['optimizer']:.2f} ms")
    shares = prof["class_share"]
    lines.append(f"  shares: matmul {100 * shares['matmul']:.1f}%, attention {100 * shares['attention']:.1f}%, "
                 f"outside matmul and attention {100 * prof['share_outside_matmul_attention']:.1f}%")
    lines.append(f"  {'share':>6s} {'ms':>9s} {'calls':>6s} {'class':9s} name")
    for row in prof["top"]:
        name = row["name"] if len(row["name"]) <= 110 else row["name"][:107] + "..."
        lines.append(f"  {100 * row['share']:5.1f}% {row['ms']:9.3f} {row['calls']:6d} {row['class']:9s} {name}")
    if prof.get("trace"):
        lines.append(f"  trace: {prof['trace']}")
    if prof.get("trace_note"):
        lines.append(f"  trace: {prof['trace_note']}")
    return "\n".join(lines)


def export_trace(prof, directory: str, path: str) -> dict:
    """The chrome trace, gzipped, into directory; dropped (and said so) when over TRACE_LIMIT_BYTES."""
    raw = os.path.join(directory, f"trace_{path.replace('+', '_')}.json")
    packed = raw + ".gz"
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except Exception as exc:  # the table is worth more than the trace: keep going
        return {"trace": None, "trace_note": f"not written ({type(exc).__name__}: {str(exc)[:200]})"}
    finally:
        if os.path.exists(raw):
            os.remove(raw)
    size = os.path.getsize(packed)
    if size > TRACE_LIMIT_BYTES:
        os.remove(packed)
        return {"trace": None, "trace_note": f"dropped: {size / 1e6:.1f} MB gzipped > {TRACE_LIMIT_BYTES / 1e6:.0f} MB"}
    return {"trace": packed, "trace_bytes": size}


# ---------------------------------------------------------------------------------------------------- one path

def triton_refusal(choice: dict, device) -> str | None:
    """Why this path's Triton kernels cannot run on `device` here; None when they can or it has none (the fused
    activation's CPU implementation is its torch reference: no Triton needed there)."""
    from moe.triton_support import triton_problem

    needs = choice.get("expert_wgrad") == "triton" or (choice.get("expert_activation") == "fused"
                                                       and device.type == "cuda")
    problem = triton_problem(device) if needs else None
    return f"needs the Triton kernels, which cannot run here: {problem}" if problem else None


def run_one_path(args) -> dict:
    """Build, warm up and time one path in this process; the result as a dict (printed as JSON)."""
    if args.device == "cpu":
        os.environ["MEGAGSPO_DEVICE"] = "cpu"
    import torch

    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.experts import STACK_FALLBACKS
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
    refusal = triton_refusal(choice or {}, torch.device(args.device))
    if refusal:
        return {"path": args.one_path, "failed": [refusal]}
    implementation = ModelImplementation(recompute=args.recompute, **(choice or {}))
    model = build_model(arch, params_dtype=params_dtype(DTYPES[args.dtype]), implementation=implementation,
                        use_transformer_engine=choice is None)
    ddp = wrap_data_parallel(model)
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=1e-5))
    device = next(model.parameters()).device
    k = args.micro_batches
    profile = bool(args.profile) and args.one_path == PROFILED_PATH
    n_steps = args.warmup + args.steps + (1 if profile else 0)
    gen = torch.Generator().manual_seed(0)
    # every micro-batch of every step its own tokens (routing differs from pass to pass, as in a real run)
    tokens = torch.randint(0, arch.vocab_size, (n_steps, k, args.micro_batch, args.seq + 1), generator=gen).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward_backward(step_tokens):
        losses = []
        for tokens_BS in step_tokens:
            logits_BSV = forward_logits(model, tokens_BS[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits_BSV.float().flatten(0, 1), tokens_BS[:, 1:].flatten())
            (loss / k).backward()
            losses.append(loss.detach())
        return losses

    def finish_and_step():
        finish_gradients(ddp)
        optimizer_step(optimizer)  # reads the grad norm: syncs with the device
        zero_gradients(ddp)        # the next step's accumulation starts from zero

    def step(i, annotate=False):
        """-> (fwd+bwd seconds, optimizer seconds, the micro-batches' losses)."""
        sync()
        start = time.perf_counter()
        if annotate:
            with torch.profiler.record_function("bench::fwd_bwd"):
                losses = forward_backward(tokens[i])
                sync()
        else:
            losses = forward_backward(tokens[i])
            sync()
        mid = time.perf_counter()
        if annotate:
            with torch.profiler.record_function("bench::optimizer"):
                finish_and_step()
                sync()
        else:
            finish_and_step()
            sync()
        return mid - start, time.perf_counter() - mid, losses

    zero_gradients(ddp)
    for i in range(args.warmup):
        step(i)
    fwdbwd, opt, losses = [], [], []
    for i in range(args.warmup, args.warmup + args.steps):
        f, o, losses = step(i)
        fwdbwd.append(f)
        opt.append(o)
    peak = _peak_bytes(device)
    loss = float(torch.stack(losses).mean())
    fwdbwd_s = statistics.median(fwdbwd)
    opt_s = statistics.median(opt)
    step_s = statistics.median(f + o for f, o in zip(fwdbwd, opt))
    per_mb = fwdbwd_s / k
    flops_mb = model_flops_per_step(arch, args.micro_batch, args.seq)
    tokens_mb = args.micro_batch * args.seq
    result = {
        "path": args.one_path,
        "micro_batches": k,
        "fwd_bwd_ms_per_step": 1e3 * fwdbwd_s,
        "fwd_bwd_ms_per_micro_batch": 1e3 * per_mb,
        "fwd_bwd_tflops": flops_mb / per_mb / 1e12,
        "fwd_bwd_tokens_per_s": tokens_mb / per_mb,
        "optimizer_ms": 1e3 * opt_s,
        "optimizer_share_k8": optimizer_share(per_mb, opt_s, SHARE_AT_K),
        "optimizer_share_at_k": optimizer_share(per_mb, opt_s, k),
        "step_ms": 1e3 * step_s,
        "step_tflops": k * flops_mb / step_s / 1e12,
        "step_tokens_per_s": k * tokens_mb / step_s,
        "fwd_bwd_ms_all": [1e3 * t for t in fwdbwd],
        "optimizer_ms_all": [1e3 * t for t in opt],
        "peak_bytes": peak,
        "peak_gib": peak / 2**30,
        "peak_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "VmHWM (process peak RSS)",
        "loss": loss,
        # the grouped experts' [E, N, K] operand: a zero-copy view of DDP's buffer, or a stacked copy (counted)
        "expert_stack_fallbacks": dict(STACK_FALLBACKS),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
    }
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        try:  # optional: a profiler failure must not cost the timings above
            os.makedirs(args.profile, exist_ok=True)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch_profile(activities=activities) as prof:
                step(n_steps - 1, annotate=True)
            summary = summarize_profile(prof.events(), on_device=device.type == "cuda")
            summary.update(export_trace(prof, args.profile, args.one_path))
            table = os.path.join(args.profile, f"profile_{args.one_path.replace('+', '_')}.txt")
            with open(table, "w") as f:
                f.write(format_profile(args.one_path, summary) + "\n")
            summary["table"] = table
        except Exception as exc:
            summary = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        result["profile"] = summary
    saved = saved_for_backward_bytes(model, lambda: forward_logits(model, tokens[0, 0, :, :-1]))
    result["saved_gib"] = saved / 2**30
    return result


# ---------------------------------------------------------------------------------------------------- main

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
    k = args.micro_batches
    tokens_mb = args.micro_batch * args.seq
    flops_mb = model_flops_per_step(arch, args.micro_batch, args.seq)
    print(f"train step: {args.layers} layers, hidden {arch.hidden_size}, {arch.num_experts} experts top-"
          f"{arch.num_experts_per_tok}, expert FFN {arch.moe_intermediate_size}, heads {arch.num_attention_heads}/"
          f"{arch.num_key_value_heads} x {arch.head_dim}, vocab {arch.vocab_size}; micro-batch {args.micro_batch} x "
          f"seq {args.seq} = {tokens_mb} tokens, {k} micro-batches per optimizer step; {args.dtype}; recompute "
          f"{args.recompute}; median of {args.steps} optimizer steps after {args.warmup} warm-up; load average "
          f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print(f"model FLOPs per micro-batch (3 x forward, causal attention at half): {flops_mb / 1e12:.4g} TFLOP; "
          f"per optimizer step: {k * flops_mb / 1e12:.4g} TFLOP")
    print(f"{'path':18s} {'fb ms/mb':>9s} {'fb tok/s':>10s} {'fb TF/s':>9s} {'opt ms':>9s} {'opt@k8':>7s} "
          f"{'step s':>9s} {'step TF/s':>9s} {'peak GiB':>9s} {'saved GiB':>9s} {'loss':>8s}  device")
    ok = [r for r in results if "fwd_bwd_tflops" in r]
    for r in results:
        if "fwd_bwd_tflops" not in r:
            print(f"{r['path']:18s} {'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + ' '.join(r['failed'])}")
            continue
        print(f"{r['path']:18s} {r['fwd_bwd_ms_per_micro_batch']:9.2f} {r['fwd_bwd_tokens_per_s']:10.1f} "
              f"{r['fwd_bwd_tflops']:9.4g} {r['optimizer_ms']:9.2f} {100 * r['optimizer_share_k8']:6.1f}% "
              f"{r['step_ms'] / 1e3:9.4f} {r['step_tflops']:9.4g} {r['peak_gib']:9.3f} {r['saved_gib']:9.3f} "
              f"{r['loss']:8.4f}  {r['device']}")
    for r in ok:
        print(f"{r['path']} fwd+bwd: {r['fwd_bwd_ms_per_micro_batch']:.2f} ms/micro-batch, "
              f"{r['fwd_bwd_tflops']:.4g} TFLOP/s; optimizer: {r['optimizer_ms']:.2f} ms/step "
              f"(share at k=8: {100 * r['optimizer_share_k8']:.1f}%); step: {r['step_ms']:.2f} ms, "
              f"{r['step_tflops']:.4g} TFLOP/s at k={k}; peak {r['peak_gib']:.2f} GiB")
        if r.get("expert_stack_fallbacks"):
            print(f"{r['path']}: expert weights STACKED instead of viewed: {r['expert_stack_fallbacks']}")
    base = ok[0] if ok else None
    for r in ok:
        if r is not base:
            print(f"{r['path']} vs {base['path']}: fwd+bwd "
                  f"{base['fwd_bwd_ms_per_micro_batch'] / r['fwd_bwd_ms_per_micro_batch']:.2f}x faster, step "
                  f"{base['step_ms'] / r['step_ms']:.2f}x faster, peak memory {r['peak_gib'] / base['peak_gib']:.2f}x, "
                  f"saved for backward {r['saved_gib'] / base['saved_gib']:.2f}x")
    for r in ok:
        if "profile" in r:
            print(format_profile(r["path"], r["profile"]))
    if args.profile and not any("profile" in r for r in ok):
        print(f"profile: not taken (only the {PROFILED_PATH} path is profiled, and it did not run)")
    if args.json:
        device_name = next((r["device"] for r in ok), None)
        if device_name is None and args.device == "cuda" and torch.cuda.is_available():
            device_name = torch.cuda.get_device_name()
        facts = {
            "arch": {"layers": arch.num_hidden_layers, "hidden": arch.hidden_size, "experts": arch.num_experts,
                     "topk": arch.num_experts_per_tok, "moe_ffn": arch.moe_intermediate_size,
                     "heads": arch.num_attention_heads, "kv_heads": arch.num_key_value_heads,
                     "head_dim": arch.head_dim, "vocab": arch.vocab_size, "arch_file": args.arch_file or None},
            "micro_batch": args.micro_batch, "seq": args.seq, "tokens_per_micro_batch": tokens_mb,
            "micro_batches": k, "k": k, "tokens_per_step": k * tokens_mb, "dtype": args.dtype, "recompute": args.recompute,
            "warmup": args.warmup, "steps": args.steps, "device_kind": args.device, "device": device_name,
            "torch": torch.__version__, "load_average": os.getloadavg()[0],
            "model_flops_per_micro_batch": flops_mb, "model_flops_per_step": k * flops_mb,
            "share_at_k": SHARE_AT_K, "results": results,
        }
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1)
        print(f"json: {args.json}")
    if any("failed" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
