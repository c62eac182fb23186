"""benchmarks/bench_logprob.py on the CPU at tiny shapes: --json (the keys tools/gpu_goals.py reads), the
hidden path's preallocated float32 d-weight buffer and its float64 error line, the text lines a script parses,
and the GSPO timing of the ops called directly. The CUDA branches (events, bandwidth yardsticks) run on the
GPU host only (tools/gpu_check.sh stages lp-logits / lp-hidden)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import megagspo.kernels as K

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_logprob.py")

pytestmark = pytest.mark.skipif(not K.fused_available("cpu"), reason="megagspo._C not built (make ext)")


def _bench(tmp_path, *extra):
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--repeats", "1", "--json", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


GOALS = {"fused_fwd_x_read", "fused_bwd_x_read_write", "fused_inplace_fwd_x_read", "fused_inplace_bwd_x_read_write",
         "hidden_tflops", "hidden_extra_gib", "gspo_ratio"}


def test_logits_mode_json_and_gspo_line(tmp_path):
    text, doc = _bench(tmp_path, "--tokens", "512", "--vocab", "2048", "--paths", "fused,fused-inplace")
    assert doc["mode"] == "logits" and set(doc["goals"]) == GOALS
    assert [r["path"] for r in doc["results"]] == ["fused", "fused-inplace"]
    for row in doc["results"]:
        assert row["fwd_s"] > 0 and row["fwd_bwd_s"] > 0
        assert row["fwd_x_read"] is None and row["bwd_x_read_write"] is None  # no bandwidth yardstick on the CPU
    g = doc["gspo"]
    assert g["timer"] == "host_clock" and g["ratio"] == pytest.approx(g["gspo_fwd_bwd_s"] / g["elementwise_s"])
    assert doc["goals"]["gspo_ratio"] == g["ratio"] and g["kernel_ms"] == pytest.approx(g["gspo_fwd_bwd_s"] * 1e3)
    m = re.search(r"^segmented GSPO fwd\+bwd over T=512, \d+ sequences: .*\(ratio ([\d.]+);", text, re.M)
    assert m and float(m.group(1)) == pytest.approx(g["ratio"], abs=0.06)


@pytest.mark.parametrize("buffer", [True, False], ids=["weight_grad_buffer", "own_accumulator"])
def test_hidden_mode_buffer_error_line_and_json(tmp_path, buffer):
    args = ["--hidden", "32", "--tokens", "96", "--vocab", "1000", "--chunk", "32", "--paths", "hidden,naive-linear",
            "--check-tokens", "40"]
    text, doc = _bench(tmp_path, *args, *([] if buffer else ["--no-weight-grad-buffer"]))
    rows = {r["path"]: r for r in doc["results"]}
    hidden = rows["hidden"]
    assert hidden["weight_grad_buffer"] is buffer
    assert hidden["weight_grad_buffer_bytes"] == (1000 * 32 * 4 if buffer else 0)
    assert doc["goals"]["hidden_tflops"] == hidden["tflops"] > 0
    assert doc["goals"]["hidden_extra_gib"] == hidden["extra_gib"]
    err = doc["hidden_error"]
    assert err["tokens"] == 40
    # float32 against float64: at the level of the naive float32 path
    assert err["logp_max_abs"] < 1e-4 and err["d_hidden_rel"] < 1e-5 and err["d_weight_rel"] < 1e-5
    assert hidden["max_rel_err"] == max(err["d_hidden_rel"], err["d_weight_rel"])
    row = re.search(r"^hidden +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$", text, re.M)  # columns 4 (speed), 6 (extra)
    assert row and float(row.group(3)) == pytest.approx(hidden["tflops"] * 1e3, rel=0.01, abs=0.06)
    assert float(row.group(5)) == pytest.approx(hidden["extra_gib"], abs=6e-4)
    assert re.search(r"^hidden: error vs float64 on 40 tokens: logp max \|err\| ", text, re.M)
