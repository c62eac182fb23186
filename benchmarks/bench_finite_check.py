"""Cost of the finite check on HF weights (moe.hf_checkpoint.all_finite) against reading the same bytes from a
page-cached safetensors file into bf16 parameters, as `load_hf_checkpoint` does (docs/robustness.md).

    python benchmarks/bench_finite_check.py [GiB=1.0] [threads=1]

Writes a GiB-sized set of 16 bf16 tensors under /tmp, then per tensor: copy the slice in, check it with
torch.isfinite(...).all() or with torch.aminmax (what the loader uses). Best of 3."""
import os, sys, time, tempfile
import torch
from safetensors.torch import save_file
from safetensors import safe_open
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
n_t = 16
per = int(gib * (1 << 30) / 2 / n_t)
rows = 768
d = tempfile.mkdtemp()
path = os.path.join(d, "m.safetensors")
save_file({f"t{i}": torch.randn(per // rows, rows, dtype=torch.bfloat16) for i in range(n_t)}, path)
params = [torch.empty(per // rows, rows, dtype=torch.bfloat16) for _ in range(n_t)]
def check_isfinite(p): return bool(torch.isfinite(p).all())
def check_aminmax(p):
    lo, hi = torch.aminmax(p)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
def run(check):
    t_read = t_check = 0.0
    with safe_open(path, "pt") as f:
        for k, p in zip(sorted(f.keys(), key=lambda s: int(s[1:])), params):
            t0 = time.perf_counter(); p.copy_(f.get_slice(k)[:]); t1 = time.perf_counter()
            if check: assert check(p)
            t2 = time.perf_counter()
            t_read += t1 - t0; t_check += t2 - t1
    return t_read, t_check
run(None)
for name, c in (("none", None), ("isfinite", check_isfinite), ("aminmax", check_aminmax)):
    best = min((run(c) for _ in range(3)), key=lambda r: r[0] + r[1])
    print(f"{gib:.2f} GiB bf16, threads={torch.get_num_threads()}, {name}: read+copy {best[0]:.3f} s, check {best[1]:.3f} s "
          f"({best[1] / best[0] * 100:.0f}% of the read)")
os.remove(path)
