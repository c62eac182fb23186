"""Light commands stay light: `megagspo plan`, `export`, `ablate` and `train --dry-run` never load Megatron-Core (only
the trainer does, megagspo.commands' one lazy import). Since cb5a536 the preflight imported the rollout sources and
with them the policy code: `plan` took 3.8-4.0 s and 425 MB instead of 1.3-1.5 s and 281 MB."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO

CHECK = """
import sys
from megagspo.cli import main
rc = main({argv!r})
loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
print("MEGATRON_MODULES", len(loaded), loaded[:3])
sys.exit(rc)
"""


@pytest.mark.parametrize("argv", [
    ["plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml"],
    ["train", "--dry-run", "--config", "configs/tiny_cpu.yaml"],
    ["train", "--dry-run", "--config", "configs/tiny_cpu.yaml", "rollout.staleness=2", "rl.filter.enabled=true"],
], ids=["plan", "dry-run", "dry-run producer"])
def test_light_commands_do_not_load_megatron(argv):
    proc = subprocess.run([sys.executable, "-c", CHECK.format(argv=argv)], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "MEGATRON_MODULES 0 []" in proc.stdout, proc.stdout[-2000:]


def test_the_light_commands_imports_load_no_megatron():
    """What the CLI imports for every command but the trainer's run (megagspo.commands and the modules its light
    commands call), checked in a fresh interpreter."""
    code = ("import sys, megagspo.commands, megagspo.dry_run, megagspo.planner, megagspo.hf_export, "
            "megagspo.trainer.preflight\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
