"""The machine an ablation ran on, recorded by the runner and named in the report: the v1 report (2026-11-28) did
not reproduce on another machine of the same kind because the CPU's arithmetic differed (cold starts 0.620 vs
0.653 on seed 0 from the same code), so a report says which CPU, which vector unit torch used, and which torch.

    <out>/machines.jsonl    one line per `megagspo ablate` invocation that ran something
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Dict, List

MACHINES_FILE = "machines.jsonl"
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma")


def cpu_info(path: str = "/proc/cpuinfo") -> Dict[str, str]:
    """The first processor's model name, family / model / stepping and the vector flags that change float
    arithmetic in torch's CPU kernels; {} where the file does not exist (not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(200_000)
    except OSError:
        return {}
    fields: Dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", "unknown"),
            "cpu_id": f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')} "
                      f"stepping {fields.get('stepping', '?')}",
            "cpu_flags": " ".join(f for f in _FLAGS if f in flags) or "none of " + " ".join(_FLAGS)}


def machine_info() -> Dict[str, object]:
    info: Dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "cores": os.cpu_count(), "python": platform.python_version(), **cpu_info()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # the record must not stop an ablation; the report then names no torch
        pass
    return info


def record_machine(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, MACHINES_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps(machine_info()) + "\n")


def read_machines(out_dir: str) -> List[Dict[str, object]]:
    """The distinct machines (date aside) that ran this ablation's runs, first seen first."""
    path = os.path.join(out_dir, MACHINES_FILE)
    if not os.path.isfile(path):
        return []
    seen, out = set(), []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            key = json.dumps({k: v for k, v in rec.items() if k != "date"}, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(rec)
    return out


def machine_lines(out_dir: str) -> List[str]:
    """The report's lines naming the machines; a note when none was recorded (runs from elsewhere)."""
    machines = read_machines(out_dir)
    if not machines:
        return ["Machine: not recorded (the runs were not made by `megagspo ablate` into this folder).", ""]
    lines = ["Ran on" + (" (more than one machine: compare with care)" if len(machines) > 1 else "") + ":"]
    for m in machines:
        lines.append(f"- {m.get('cpu', 'unknown CPU')} ({m.get('cpu_id', '?')}; flags: {m.get('cpu_flags', '?')}), "
                     f"{m.get('cores', '?')} cores; torch {m.get('torch', '?')} "
                     f"(CPU kernels: {m.get('torch_cpu_capability', '?')}), Python {m.get('python', '?')}; "
                     f"first run {m.get('date', '?')}")
    return lines + [""]
