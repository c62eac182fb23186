"""Golden metrics: a short run of the tiny recipe (cold-start SFT, then GSPO) logs the same metrics as the
run recorded in tests/assets/golden_tiny_metrics.json — every logged value but timings and throughput, to a
float32-noise tolerance. A change that alters training (a loss, a reduction order, an RNG draw, a data order)
shows here even when every unit test still passes.

Regenerate only for an intended change of dynamics, and say so in the commit:
    MEGAGSPO_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_metrics.py
"""

import json
import math
import os
import subprocess
import sys

from multiprocess import cpu_pinned_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "assets", "golden_tiny_metrics.json")
# digit_match's partial credit gives nonzero advantages and clipped sequences within 4 steps of a short SFT.
RUN = ["sft.steps=20", "sft.batch_size=32", "reward.name=digit_match", "rl.steps=4", "rl.prompts_per_step=8",
       "rl.group_size=4", "rl.mini_batches=2", "rl.eval_every=3", "rl.eval_samples=0", "data.train_size=200", "data.eval_size=20",
       "threads=1", "log.progress=false", "log.plots=false", "log.tensorboard=false", "log.save_checkpoint=false",
       "checkpoint.every_steps=0"]
# Wall-clock quantities and memory peaks differ run to run; everything else is a function of the seed.
UNTIMED = ("time/", "throughput/", "memory/")
# float32 results may differ in the last bits between CPU instruction sets (AVX2 / AVX-512 kernels).
RTOL, ATOL = 1e-4, 1e-6


def _rows(tmp_path):
    env = cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megagspo.cli", "train", "--config", "configs/tiny_cpu.yaml", *RUN,
                           "name=golden", f"log.out_dir={tmp_path}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "golden" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def test_tiny_run_logs_the_golden_metrics(tmp_path):
    rows = _rows(tmp_path)
    if os.environ.get("MEGAGSPO_WRITE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            json.dump({"command": "megagspo train --config configs/tiny_cpu.yaml " + " ".join(RUN), "rows": rows},
                      f, indent=1)
    with open(GOLDEN) as f:
        golden = json.load(f)["rows"]
    assert len(rows) == len(golden), f"{len(rows)} rows logged, the golden run has {len(golden)}"
    for i, (row, want) in enumerate(zip(rows, golden)):
        assert sorted(row) == sorted(want), f"row {i}: keys {sorted(set(row) ^ set(want))} differ"
        for key, value in want.items():
            got = row[key]
            same = got == value if isinstance(value, str) else math.isclose(got, value, rel_tol=RTOL, abs_tol=ATOL)
            assert same, f"row {i} ({want.get('phase')} step {want.get('step')}): {key} = {got}, golden {value}"
