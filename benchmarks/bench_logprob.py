#!/usr/bin/env python
"""Token log-probs side by side in one run: time and peak memory. Two modes.

From logits (default):
    python benchmarks/bench_logprob.py --tokens 2048 --vocab 151936 --dtype float32 --device cpu
    python benchmarks/bench_logprob.py --tokens 32768 --vocab 151936 --dtype bfloat16 --device cuda
  naive          log_softmax(logits.float()).gather(target)  (autograd; materialises float32 [T, V])
  fused          megagspo.kernels.token_logprobs(impl="fused")
  fused-inplace  the same with inplace_backward=True (d logits written over the logits)

From hidden states and the LM head weight (--hidden H; the trainer's model.logprob_path=hidden):
    python benchmarks/bench_logprob.py --hidden 2048 --tokens 16384 --vocab 151936 --dtype bfloat16 --device cuda
    python benchmarks/bench_logprob.py --hidden 256 --tokens 2048 --vocab 32768 --dtype float32 --device cpu
  naive-linear   hidden @ weight^T, then the naive log-softmax (materialises [T, V] and float32 [T, V])
  hidden         megagspo.kernels.linear_token_logprobs (chunks of --chunk tokens; the trainer's path)
  liger          Liger's LigerFusedLinearCrossEntropyLoss (reduction sum)      } optional, GPU hosts: where not
  cce            Cut Cross-Entropy's linear_cross_entropy (reduction sum)      } importable, the reason is printed
  Inputs hidden [T, H], weight [V, H]; forward+backward gives d hidden and d weight; useful FLOPs 6 T H V.
  Liger and CCE compute the summed cross entropy (= -sum logp), the same gradient as sum logp up to sign;
  CCE filters gradients below its filter_eps ("auto") by default, so it does less work than an exact path.

Each path runs in a fresh subprocess (CPU) so its peak memory is its own: the peak resident set (VmHWM) is
reset with /proc/self/clear_refs after the inputs exist, then one forward+backward runs. "extra" is the
growth beyond the inputs' gradients the caller asked for (d logits from logits, which the in-place mode places
in the logits' own storage; d hidden and d weight from hidden states). On CUDA, torch.cuda.max_memory_allocated
is used, and in the logits mode the logits read / read+write times (amax, copy) are printed as the bandwidth
yardsticks of the GPU targets. Also times the segmented GSPO kernel against a trivial elementwise kernel.

The `hidden` path passes a preallocated float32 [V, H] d-weight buffer (--weight-grad-buffer, on by default),
as the trainer passes Megatron DDP's main_grad: backward adds d weight into it and no [V, H] gradient exists.
The buffer is allocated with the inputs, before the peak counter is reset, and is NOT counted as "extra":
it is the gradient the caller owns (as d hidden, returned, is subtracted from the peak). With
--no-weight-grad-buffer the kernel allocates its own float32 accumulator and returns a [V, H] d weight in the
weight's dtype (the returned tensor is subtracted; the accumulator counts as extra). After the rows, the
hidden path's logp, d hidden and d weight are checked against float64 on the first --check-tokens tokens
(one more forward+backward of the kernel on that slice, not timed): max |logp error|, and ||error|| / ||ref||
of d hidden and d weight, beside the same numbers for the naive path in the same dtype (the yardstick).

Segmented GSPO timing (what exactly is timed): the two ops of the fused loss, called directly with inputs
already in the kernel's layout -- torch.ops.megagspo.gspo_segment_forward (loss + per-sequence
coefficients) then torch.ops.megagspo.gspo_segment_backward (d logp) -- against one elementwise kernel over
the same T floats (torch.mul(x, 2, out=y)). Autograd's graph bookkeeping and the Python wrapper's argument
handling are not the kernel's and are not in that ratio; the full autograd call (gspo_segment_loss +
loss.backward()) is timed too and reported beside it. On CUDA each call is bracketed by torch.cuda.Event
records and the median over --repeats (>= 20) calls is taken; a long torch.cuda._sleep is queued first so that
the host enqueues every call ahead of the GPU: the events then time the GPU's work, not host launch gaps.
On the CPU: host clocks (time.perf_counter), median per call.

--json FILE writes every row and ratio machine-readably (times in seconds, memory in bytes unless the key
says GiB or ms; null where not measured, e.g. the bandwidth ratios on the CPU); tools/gpu_goals.py reads it:
  mode                     "logits" or "hidden"
  args                     the command-line arguments
  device_name, torch       the device (GPU name or "cpu") and torch's version
  results                  one row per path run, in order: path, fwd_s, fwd_bwd_s, fwd_extra_bytes,
                             fwd_bwd_extra_bytes, logits_bytes, and
                             logits mode: read_s, read_write_s (CUDA only), fwd_x_read (fwd_s / read_s),
                               bwd_x_read_write ((fwd_bwd_s - fwd_s) / read_write_s) (null on the CPU)
                             hidden mode: tflops (useful 6THV FLOPs / fwd_bwd_s / 1e12, also on the CPU),
                               extra_gib (= fwd_bwd_extra_bytes in GiB), weight_grad_buffer (bool),
                               weight_grad_buffer_bytes; the hidden row also max_rel_err (the larger of
                               hidden_error's d_hidden_rel and d_weight_rel; null without the check)
  skipped.<path>           why an optional path did not run
  goals                    the headline numbers, flat (null when not measured in this mode / device):
    fused_fwd_x_read                 fused fwd time / one read of the logits (amax)
    fused_bwd_x_read_write           fused (fwd+bwd - fwd) time / one read+write of the logits (copy)
    fused_inplace_fwd_x_read         the same for fused-inplace
    fused_inplace_bwd_x_read_write
    hidden_tflops                    hidden path, useful TFLOP/s of fwd+bwd
    hidden_extra_gib                 hidden path, fwd+bwd extra GiB (buffer not counted, see above)
    gspo_ratio                       segmented GSPO fwd+bwd kernels / one elementwise kernel (logits mode)
  gspo                     (logits mode) sequences, gspo_fwd_s, gspo_bwd_s, gspo_fwd_bwd_s (the two ops),
                             autograd_fwd_bwd_s, elementwise_s, ratio (gspo_fwd_bwd_s / elementwise_s),
                             autograd_ratio, kernel_ms / trivial_ms (gspo_fwd_bwd_s / elementwise_s in ms),
                             timer ("cuda_events" or "host_clock")
  hidden_error             (hidden mode) tokens, logp_max_abs, d_hidden_rel, d_weight_rel, and
                             naive_logp_max_abs, naive_d_hidden_rel, naive_d_weight_rel (naive path, same dtype)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import megagspo.kernels as K  # noqa: E402

PATHS = ("naive", "fused", "fused-inplace")
LINEAR_PATHS = ("naive-linear", "hidden", "liger", "cce")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


# ---- memory probes ---------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak(device: torch.device) -> int:
    """Reset the peak counter; return the current bytes in use."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_kib("VmRSS") * 1024


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- one path ----------------------------------------------------------------------------------------------
def _make_inputs(args, device):
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    base = torch.randn(args.tokens, args.vocab, device=device, dtype=torch.float32).mul_(3).to(dtype)
    target = torch.randint(0, args.vocab, (args.tokens,), device=device)
    return base, target


def _step(path, base, target, with_entropy, backward):
    """One forward (+ backward): returns (logp, d logits or None). `base` is a leaf; the in-place path works
    on a non-leaf view of it (as on the LM-head output in training)."""
    leaf = base.detach().requires_grad_(backward)
    logits = leaf.view(leaf.shape) if path == "fused-inplace" else leaf
    if path == "naive":
        lsm = torch.log_softmax(logits.float(), dim=-1)
        logp = lsm.gather(1, target[:, None]).squeeze(1)
        out = logp + (-(lsm.exp() * lsm).sum(-1)) * 0.1 if with_entropy else logp
    else:
        res = K.token_logprobs(logits, target, with_entropy=with_entropy, impl="fused",
                               inplace_backward=path == "fused-inplace")
        out = res[0] + 0.1 * res[1] if with_entropy else res
    if not backward:
        return out.detach(), None
    (grad,) = torch.autograd.grad(out.sum(), logits)
    return out.detach(), grad


def _optional_linear_ce(path):
    """The one guard of the optional heavy libraries: (loss_fn(hidden, weight, target) -> summed CE, None) or
    (None, why it is not importable)."""
    try:
        if path == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            return (lambda h, w, t: loss(w, h, t)), None
        from cut_cross_entropy import linear_cross_entropy

        return (lambda h, w, t: linear_cross_entropy(h, w, t, reduction="sum")), None
    except Exception as exc:  # ImportError, or a Triton / CUDA-only import failing on this host
        package = "liger-kernel" if path == "liger" else "cut-cross-entropy"
        return None, f"{package} is not importable here ({type(exc).__name__}: {exc}); it needs a GPU host"


def _make_linear_inputs(args, device):
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.float32).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, device=device, dtype=torch.float32) * (3 / args.hidden**0.5)).to(dtype)
    target = torch.randint(0, args.vocab, (args.tokens,), device=device)
    return hidden, weight, target


def _step_linear(path, hidden, weight, target, args, backward, weight_grad_buffer=None):
    """One forward (+ backward) from hidden states: returns (summed log-prob, (d hidden, d weight) or None).
    weight_grad_buffer (hidden path): d weight is added into it; the returned d weight is then None."""
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    if path == "naive-linear":
        lsm = torch.log_softmax((h @ w.t()).float(), dim=-1)
        out = lsm.gather(1, target[:, None]).sum()
        if args.entropy:
            out = out - 0.1 * (lsm.exp() * lsm).sum()
    elif path == "hidden":
        res = K.linear_token_logprobs(h, w, target, chunk_size=args.chunk, with_entropy=args.entropy, impl="fused",
                                      weight_grad_buffer=weight_grad_buffer if backward else None)
        out = (res[0] + 0.1 * res[1]).sum() if args.entropy else res.sum()
    else:
        loss_fn, why = _optional_linear_ce(path)
        if loss_fn is None:
            raise RuntimeError(why)
        out = -loss_fn(h, w, target)
    if not backward:
        return out.detach(), None
    # allow_unused: with a weight_grad_buffer autograd receives no d weight (it is in the buffer)
    return out.detach(), torch.autograd.grad(out, (h, w), allow_unused=weight_grad_buffer is not None)


def run_linear_path(args) -> dict:
    device = torch.device(args.device)
    path = args.child
    hidden, weight, target = _make_linear_inputs(args, device)
    result = {"path": path, "logits_bytes": args.tokens * args.vocab * hidden.element_size()}
    # the caller's float32 d-weight buffer (the trainer's main_grad): allocated with the inputs, so it is not in
    # the "extra" peak; backward accumulates into it over the repeats (its values are not read here)
    buffer = None
    if path == "hidden" and args.weight_grad_buffer:
        buffer = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    result["weight_grad_buffer"] = buffer is not None
    result["weight_grad_buffer_bytes"] = buffer.numel() * buffer.element_size() if buffer is not None else 0
    _step_linear(path, hidden, weight, target, args, True, buffer)  # warm-up
    for backward in (False, True):
        key = "fwd_bwd" if backward else "fwd"
        times, peak_extra = [], None
        for rep in range(args.repeats):
            _sync(device)
            before = _reset_peak(device)
            t0 = time.perf_counter()
            out, grads = _step_linear(path, hidden, weight, target, args, backward, buffer)
            _sync(device)
            times.append(time.perf_counter() - t0)
            if rep == 0:
                grad_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None) if grads else 0
                peak_extra = _peak(device) - before - grad_bytes
            del out, grads
        result[key + "_s"] = statistics.median(times)
        result[key + "_extra_bytes"] = peak_extra
    return result


def check_linear_error(args) -> dict:
    """The hidden path's logp, d hidden and d weight on the first --check-tokens tokens against float64 (the
    same inputs, cast), and the naive path in the bench's dtype as the yardstick. Not timed."""
    device = torch.device(args.device)
    hidden, weight, target = _make_linear_inputs(args, device)
    n = min(args.check_tokens, args.tokens)
    hidden, target = hidden[:n].contiguous(), target[:n].contiguous()

    def run(fn, h0, w0, buffer=None):
        h = h0.detach().clone().requires_grad_()
        w = w0.detach().clone().requires_grad_()
        res = fn(h, w, buffer)
        lp = res[0] if args.entropy else res
        out = (res[0] + 0.1 * res[1]).sum() if args.entropy else res.sum()
        out.backward()
        d_w = buffer if buffer is not None else w.grad
        return lp.detach().double(), h.grad.double(), d_w.double()

    def kernel(h, w, buffer):
        return K.linear_token_logprobs(h, w, target, chunk_size=args.chunk, with_entropy=args.entropy, impl="fused",
                                       weight_grad_buffer=buffer)

    def naive(h, w, _buffer):
        return K.linear_token_logprobs_ref(h, w, target, args.entropy)

    ref = run(naive, hidden.double(), weight.double())
    buffer = torch.zeros(weight.shape, dtype=torch.float32, device=device) if args.weight_grad_buffer else None
    got = run(kernel, hidden, weight, buffer)
    del buffer
    yard = run(naive, hidden, weight)

    def errs(x, prefix):
        return {prefix + "logp_max_abs": (x[0] - ref[0]).abs().max().item(),
                prefix + "d_hidden_rel": ((x[1] - ref[1]).norm() / ref[1].norm().clamp_min(1e-300)).item(),
                prefix + "d_weight_rel": ((x[2] - ref[2]).norm() / ref[2].norm().clamp_min(1e-300)).item()}

    return {"tokens": n, **errs(got, ""), **errs(yard, "naive_")}


def run_path(args) -> dict:
    device = torch.device(args.device)
    path = args.child
    base, target = _make_inputs(args, device)
    logits_bytes = base.numel() * base.element_size()
    result = {"path": path, "logits_bytes": logits_bytes}
    # warm-up (thread pools, lazy inits); the in-place path needs fresh logits each time it runs backward
    work = base.clone() if path == "fused-inplace" else base
    _step(path, work, target, args.entropy, True)
    del work
    for backward in (False, True):
        key = "fwd_bwd" if backward else "fwd"
        times, peak_extra = [], None
        for rep in range(args.repeats):
            work = base.clone() if path == "fused-inplace" and backward else base
            _sync(device)
            before = _reset_peak(device)
            t0 = time.perf_counter()
            logp, grad = _step(path, work, target, args.entropy, backward)
            _sync(device)
            times.append(time.perf_counter() - t0)
            if rep == 0:
                grad_bytes = 0
                if grad is not None and grad.data_ptr() != work.data_ptr():
                    grad_bytes = grad.numel() * grad.element_size()
                peak_extra = _peak(device) - before - grad_bytes
            assert (logp <= 0).all() or args.entropy
            del logp, grad, work
        result[key + "_s"] = statistics.median(times)
        result[key + "_extra_bytes"] = peak_extra
    if device.type == "cuda":  # bandwidth yardsticks: one read of the logits; one read + one write
        result["read_s"] = _time_cuda(lambda: base.amax(-1), args.repeats)
        out = torch.empty_like(base)
        result["read_write_s"] = _time_cuda(lambda: out.copy_(base), args.repeats)
    return result


def _time_cuda(fn, repeats):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# queued ahead of the timed calls on CUDA: ~30-60 ms at 1-2 GHz, longer than the host needs to enqueue them
_SLEEP_CYCLES = 60_000_000


def _time_kernel(fn, repeats, device) -> float:
    """Median seconds per fn() call. CUDA: torch.cuda.Event records around each call, all queued behind a
    torch.cuda._sleep, so the events bracket the GPU's execution of fn's kernels, not the host's launch time.
    CPU: host clocks per call."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(_SLEEP_CYCLES)
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends)) / 1e3


# ---- segmented GSPO vs a trivial elementwise kernel --------------------------------------------------------
def bench_gspo(args) -> dict:
    """See the module docstring: the fused GSPO ops called directly (forward, backward, both) and through
    autograd, against one elementwise kernel over T floats."""
    device = torch.device(args.device)
    T, avg = args.tokens, args.seq_len
    torch.manual_seed(0)
    S = max(T // avg, 1)
    cuts = torch.sort(torch.randperm(T - 1)[: S - 1] + 1).values if S > 1 else torch.empty(0, dtype=torch.long)
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(device)
    old = -torch.rand(T, device=device) * 3
    logp = (old + torch.randn(T, device=device) * 1e-3).requires_grad_()
    mask = torch.rand(T, device=device) < 0.9
    adv = torch.randn(S, device=device)
    clip_low, clip_high = 3e-4, 4e-4
    reps = max(args.repeats, 20)
    ops = torch.ops.megagspo
    lp = logp.detach()
    # the op's inputs in its layout, prepared once (gspo_segment_loss does these casts on every call)
    cu_k, adv_k = cu.contiguous(), adv.float().contiguous()
    grad_one = torch.ones((), device=device)

    def fwd():
        return ops.gspo_segment_forward(lp, old, mask, cu_k, adv_k, clip_low, clip_high, float(S))

    coef_S = fwd()[4]

    def bwd():
        return ops.gspo_segment_backward(grad_one, coef_S, mask, cu_k, lp.dtype)

    def fwd_bwd():
        out = fwd()
        return ops.gspo_segment_backward(grad_one, out[4], mask, cu_k, lp.dtype)

    def autograd_fwd_bwd():
        loss, _ = K.gspo_segment_loss(logp, old, mask, cu, adv, clip_low=clip_low, clip_high=clip_high,
                                      num_global_sequences=S, impl="fused")
        loss.backward()

    x, y = lp.clone(), torch.empty_like(lp)

    def elementwise():
        return torch.mul(x, 2.0, out=y)

    with torch.no_grad():
        res = {"sequences": S,
               "gspo_fwd_s": _time_kernel(fwd, reps, device),
               "gspo_bwd_s": _time_kernel(bwd, reps, device),
               "gspo_fwd_bwd_s": _time_kernel(fwd_bwd, reps, device),
               "elementwise_s": _time_kernel(elementwise, reps, device)}
    res["autograd_fwd_bwd_s"] = _time_kernel(autograd_fwd_bwd, reps, device)
    res["ratio"] = res["gspo_fwd_bwd_s"] / res["elementwise_s"]
    res["autograd_ratio"] = res["autograd_fwd_bwd_s"] / res["elementwise_s"]
    res["kernel_ms"], res["trivial_ms"] = res["gspo_fwd_bwd_s"] * 1e3, res["elementwise_s"] * 1e3
    res["timer"] = "cuda_events" if device.type == "cuda" else "host_clock"
    return res


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"


def _write_json(args, payload: dict) -> None:
    if not args.json:
        return
    payload = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "json")},
               "device_name": _device_name(args.device), "torch": torch.__version__, **payload}
    with open(args.json, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    print(f"wrote {args.json}")


# ---- driver ------------------------------------------------------------------------------------------------
def _child_cmd(args, path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--dtype", args.dtype, "--device", args.device,
           "--repeats", str(args.repeats), "--hidden", str(args.hidden), "--chunk", str(args.chunk),
           "--weight-grad-buffer" if args.weight_grad_buffer else "--no-weight-grad-buffer"]
    return cmd + (["--entropy"] if args.entropy else [])


def main_linear(args):
    """--hidden H: the log-prob paths from hidden states, side by side (see the module docstring)."""
    results, skipped = {}, {}
    for path in args.paths.split(","):
        if path in ("liger", "cce"):
            _, why = _optional_linear_ce(path)
            if why is not None:
                skipped[path] = why
                continue
        if args.device == "cpu":  # fresh process: its own peak RSS
            out = subprocess.run(_child_cmd(args, path), check=True, capture_output=True, text=True)
            results[path] = json.loads(out.stdout.strip().splitlines()[-1])
        else:
            args.child = path
            results[path] = run_linear_path(args)
            args.child = None
            torch.cuda.empty_cache()
    gib = 2.0**30
    flops = 6.0 * args.tokens * args.hidden * args.vocab
    unit, scale = ("TFLOP/s", 1e12) if args.device != "cpu" else ("GFLOP/s", 1e9)
    print(f"\nLM head + log-probs from hidden states: T={args.tokens} H={args.hidden} V={args.vocab} {args.dtype} "
          f"on {args.device} (torch threads {torch.get_num_threads()}, entropy={args.entropy}, chunk {args.chunk}); "
          f"[T, V] logits would be {args.tokens * args.vocab * DTYPES[args.dtype].itemsize / gib:.2f} GiB; "
          f"median of {args.repeats}; useful FLOPs 6THV")
    print(f"{'path':<14}{'fwd s':>9}{'fwd+bwd s':>11}{unit:>10}{'fwd extra GiB':>15}{'fwd+bwd extra GiB':>19}")
    for path, r in results.items():
        r["tflops"] = flops / r["fwd_bwd_s"] / 1e12
        r["extra_gib"] = r["fwd_bwd_extra_bytes"] / gib
        print(f"{path:<14}{r['fwd_s']:>9.3f}{r['fwd_bwd_s']:>11.3f}{flops / r['fwd_bwd_s'] / scale:>10.1f}"
              f"{r['fwd_extra_bytes'] / gib:>15.3f}{r['fwd_bwd_extra_bytes'] / gib:>19.3f}")
    for path, why in skipped.items():
        print(f"{path}: skipped: {why}")
    if "hidden" in results:
        r = results["hidden"]
        if r["weight_grad_buffer"]:
            print(f"hidden: d weight added into a preallocated float32 [V, H] buffer "
                  f"({r['weight_grad_buffer_bytes'] / gib:.2f} GiB, the caller's gradient, as the trainer's "
                  f"main_grad: not counted as extra)")
        else:
            print("hidden: no weight-grad buffer: the kernel's float32 [V, H] accumulator counts as extra")
    error = None
    if "hidden" in results and args.check_tokens > 0:
        error = check_linear_error(args)
        print(f"hidden: error vs float64 on {error['tokens']} tokens: logp max |err| {error['logp_max_abs']:.3g}, "
              f"d hidden rel {error['d_hidden_rel']:.3g}, d weight rel {error['d_weight_rel']:.3g} "
              f"(naive {args.dtype}: {error['naive_logp_max_abs']:.3g}, {error['naive_d_hidden_rel']:.3g}, "
              f"{error['naive_d_weight_rel']:.3g})")
    hidden = results.get("hidden")
    if hidden is not None:
        hidden["max_rel_err"] = max(error["d_hidden_rel"], error["d_weight_rel"]) if error else None
    _write_json(args, {
        "mode": "hidden", "results": list(results.values()), "skipped": skipped, "hidden_error": error,
        "gspo": None,
        "goals": {**_NO_GOALS, "hidden_tflops": hidden["tflops"] if hidden else None,
                  "hidden_extra_gib": hidden["extra_gib"] if hidden else None}})


_NO_GOALS = {"fused_fwd_x_read": None, "fused_bwd_x_read_write": None, "fused_inplace_fwd_x_read": None,
             "fused_inplace_bwd_x_read_write": None, "hidden_tflops": None, "hidden_extra_gib": None,
             "gspo_ratio": None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--entropy", action="store_true", help="also compute (and backpropagate) the entropy")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    p.add_argument("--seq-len", type=int, default=256, help="mean sequence length of the GSPO benchmark")
    p.add_argument("--hidden", type=int, default=0,
                   help="> 0: the paths from hidden states [T, H] and an LM head [V, H] of this H")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the hidden-state kernel")
    p.add_argument("--weight-grad-buffer", action=argparse.BooleanOptionalAction, default=True,
                   help="hidden path: add d weight into a preallocated float32 [V, H] buffer, as the trainer does "
                        "with Megatron DDP's main_grad (default on; not counted as extra memory)")
    p.add_argument("--check-tokens", type=int, default=256,
                   help="hidden path: tokens of the float64 error check (0: skip it)")
    p.add_argument("--json", metavar="FILE", help="also write every row and ratio to FILE as JSON (keys above)")
    p.add_argument("--child", choices=PATHS + LINEAR_PATHS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        print(json.dumps(run_linear_path(args) if args.hidden else run_path(args)))
        return
    if not K.fused_available(args.device):
        raise SystemExit(f"megagspo._C has no kernels for {args.device}: build it first (make ext)")
    if args.hidden:
        if args.paths == ",".join(PATHS):
            args.paths = ",".join(LINEAR_PATHS)
        bad = set(args.paths.split(",")) - set(LINEAR_PATHS)
        if bad:
            raise SystemExit(f"--hidden: paths must be among {LINEAR_PATHS}; got {sorted(bad)}")
        main_linear(args)
        return

    results = {}
    for path in args.paths.split(","):
        if args.device == "cpu":  # fresh process: its own peak RSS
            out = subprocess.run(_child_cmd(args, path), check=True, capture_output=True, text=True)
            results[path] = json.loads(out.stdout.strip().splitlines()[-1])
        else:
            args.child = path
            results[path] = run_path(args)
            args.child = None
            torch.cuda.empty_cache()

    gib = 2.0**30
    lb = next(iter(results.values()))["logits_bytes"]
    print(f"\ntoken log-probs: T={args.tokens} V={args.vocab} {args.dtype} on {args.device} "
          f"(torch threads {torch.get_num_threads()}, entropy={args.entropy}); logits = {lb / gib:.2f} GiB; "
          f"median of {args.repeats}")
    print(f"{'path':<15}{'fwd s':>9}{'fwd+bwd s':>11}{'fwd extra GiB':>15}{'fwd+bwd extra GiB':>19}"
          f"{'extra B/token':>15}")
    for path, r in results.items():
        print(f"{path:<15}{r['fwd_s']:>9.3f}{r['fwd_bwd_s']:>11.3f}{r['fwd_extra_bytes'] / gib:>15.3f}"
              f"{r['fwd_bwd_extra_bytes'] / gib:>19.3f}{r['fwd_bwd_extra_bytes'] / args.tokens:>15.0f}")
    if "naive" in results:
        n = results["naive"]
        for path in (q for q in results if q != "naive"):
            r = results[path]
            # RSS moves in pages: below 1 MiB the ratio says nothing, so the divisor is floored there
            mem = n["fwd_bwd_extra_bytes"] / max(r["fwd_bwd_extra_bytes"], 2**20)
            print(f"{path} vs naive: fwd {n['fwd_s'] / r['fwd_s']:.2f}x faster, fwd+bwd "
                  f"{n['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x faster, fwd+bwd extra memory "
                  f"{r['fwd_bwd_extra_bytes'] / 2**20:.1f} MiB vs naive {n['fwd_bwd_extra_bytes'] / 2**20:.0f} MiB "
                  f"(>= {mem:.0f}x smaller)")
    for r in results.values():
        r["fwd_x_read"] = r["fwd_s"] / r["read_s"] if "read_s" in r else None
        r["bwd_x_read_write"] = (r["fwd_bwd_s"] - r["fwd_s"]) / r["read_write_s"] if "read_write_s" in r else None
    if args.device != "cpu":
        for path, r in results.items():
            print(f"{path}: fwd = {r['fwd_x_read']:.2f} x one logits read ({r['read_s'] * 1e3:.2f} ms); "
                  f"bwd = {r['bwd_x_read_write']:.2f} x read+write "
                  f"({r['read_write_s'] * 1e3:.2f} ms)")
    g = bench_gspo(args)
    timer = "CUDA events, GPU time" if g["timer"] == "cuda_events" else "host clock"
    print(f"\nsegmented GSPO fwd+bwd over T={args.tokens}, {g['sequences']} sequences: "
          f"{g['gspo_fwd_bwd_s'] * 1e6:.1f} us; trivial elementwise kernel over T: {g['elementwise_s'] * 1e6:.1f} us "
          f"(ratio {g['ratio']:.1f}; the forward and backward ops called directly, {timer}, median of "
          f"{max(args.repeats, 20)}; fwd {g['gspo_fwd_s'] * 1e6:.1f} us, bwd {g['gspo_bwd_s'] * 1e6:.1f} us; "
          f"through autograd {g['autograd_fwd_bwd_s'] * 1e6:.1f} us, ratio {g['autograd_ratio']:.1f})")

    def goal(path, key):
        return results[path][key] if path in results else None

    _write_json(args, {
        "mode": "logits", "results": list(results.values()), "skipped": {}, "hidden_error": None, "gspo": g,
        "goals": {**_NO_GOALS, "fused_fwd_x_read": goal("fused", "fwd_x_read"),
                  "fused_bwd_x_read_write": goal("fused", "bwd_x_read_write"),
                  "fused_inplace_fwd_x_read": goal("fused-inplace", "fwd_x_read"),
                  "fused_inplace_bwd_x_read_write": goal("fused-inplace", "bwd_x_read_write"),
                  "gspo_ratio": g["ratio"]}})


if __name__ == "__main__":
    main()
