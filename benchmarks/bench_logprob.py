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


def _step_linear(path, hidden, weight, target, args, backward):
    """One forward (+ backward) from hidden states: returns (summed log-prob, (d hidden, d weight) or None)."""
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    if path == "naive-linear":
        lsm = torch.log_softmax((h @ w.t()).float(), dim=-1)
        out = lsm.gather(1, target[:, None]).sum()
        if args.entropy:
            out = out - 0.1 * (lsm.exp() * lsm).sum()
    elif path == "hidden":
        res = K.linear_token_logprobs(h, w, target, chunk_size=args.chunk, with_entropy=args.entropy, impl="fused")
        out = (res[0] + 0.1 * res[1]).sum() if args.entropy else res.sum()
    else:
        loss_fn, why = _optional_linear_ce(path)
        if loss_fn is None:
            raise RuntimeError(why)
        out = -loss_fn(h, w, target)
    if not backward:
        return out.detach(), None
    return out.detach(), torch.autograd.grad(out, (h, w))


def run_linear_path(args) -> dict:
    device = torch.device(args.device)
    path = args.child
    hidden, weight, target = _make_linear_inputs(args, device)
    result = {"path": path, "logits_bytes": args.tokens * args.vocab * hidden.element_size()}
    _step_linear(path, hidden, weight, target, args, True)  # warm-up
    for backward in (False, True):
        key = "fwd_bwd" if backward else "fwd"
        times, peak_extra = [], None
        for rep in range(args.repeats):
            _sync(device)
            before = _reset_peak(device)
            t0 = time.perf_counter()
            out, grads = _step_linear(path, hidden, weight, target, args, backward)
            _sync(device)
            times.append(time.perf_counter() - t0)
            if rep == 0:
                grad_bytes = sum(g.numel() * g.element_size() for g in grads) if grads else 0
                peak_extra = _peak(device) - before - grad_bytes
            del out, grads
        result[key + "_s"] = statistics.median(times)
        result[key + "_extra_bytes"] = peak_extra
    return result


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


# ---- segmented GSPO vs a trivial elementwise kernel --------------------------------------------------------
def bench_gspo(args) -> dict:
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

    def gspo():
        loss, _ = K.gspo_segment_loss(logp, old, mask, cu, adv, num_global_sequences=S, impl="fused")
        loss.backward()

    def trivial():
        return logp.detach() * 2.0

    def timeit(fn):
        for _ in range(3):
            fn()
        _sync(device)
        reps = max(args.repeats, 20)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / reps

    return {"sequences": S, "gspo_fwd_bwd_s": timeit(gspo), "elementwise_s": timeit(trivial)}


# ---- driver ------------------------------------------------------------------------------------------------
def _child_cmd(args, path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--dtype", args.dtype, "--device", args.device,
           "--repeats", str(args.repeats), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
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
        print(f"{path:<14}{r['fwd_s']:>9.3f}{r['fwd_bwd_s']:>11.3f}{flops / r['fwd_bwd_s'] / scale:>10.1f}"
              f"{r['fwd_extra_bytes'] / gib:>15.3f}{r['fwd_bwd_extra_bytes'] / gib:>19.3f}")
    for path, why in skipped.items():
        print(f"{path}: skipped: {why}")


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
    if args.device != "cpu":
        for path, r in results.items():
            print(f"{path}: fwd = {r['fwd_s'] / r['read_s']:.2f} x one logits read ({r['read_s'] * 1e3:.2f} ms); "
                  f"bwd = {(r['fwd_bwd_s'] - r['fwd_s']) / r['read_write_s']:.2f} x read+write "
                  f"({r['read_write_s'] * 1e3:.2f} ms)")
    g = bench_gspo(args)
    print(f"\nsegmented GSPO fwd+bwd over T={args.tokens}, {g['sequences']} sequences: "
          f"{g['gspo_fwd_bwd_s'] * 1e6:.1f} us; trivial elementwise kernel over T: {g['elementwise_s'] * 1e6:.1f} us "
          f"(ratio {g['gspo_fwd_bwd_s'] / g['elementwise_s']:.1f}; includes autograd overhead)")


if __name__ == "__main__":
    main()
