"""Issue 49, item 7: a failure of the environment at start-up is one line and exit 2 for every command, naming the
cause and, where there is one, the setting or path, with no traceback from inside a library's import
(megagspo/environment.py). Before: `import torch` raising printed a 53-line traceback and every command exited 1,
`--dry-run` included. The library failures are made by a sitecustomize that raises when the named module is first
imported, as a broken install does."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from helpers import REPO
from multiprocess import cpu_pinned_env

BREAK = """
import locale, sys

class Break:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise {error}
        return None

sys.meta_path.insert(0, Break())
"""
COMMANDS = {
    "train": ["train", "--config", "configs/tiny_cpu.yaml"],
    "train --dry-run": ["train", "--dry-run", "--config", "configs/tiny_cpu.yaml"],
    "sft": ["sft", "--config", "configs/tiny_cpu.yaml"],
    "plan": ["plan", "--config", "configs/tiny_cpu.yaml"],
    "export": ["export", "--checkpoint", "runs/none"],
    "ablate": ["ablate", "--config", "configs/ablations/tiny_cpu.yaml", "--report-only"],
}


def _cli(tmp_path, module, error, args, **env):
    (tmp_path / "sitecustomize.py").write_text(BREAK.format(module=module, error=error))
    env = cpu_pinned_env(PYTHONPATH=os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-m", "megagspo.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def _one_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    assert proc.stdout == "", proc.stdout
    return lines[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_broken_torch_is_one_line_and_exit_2_for_every_command(tmp_path, command):
    proc = _cli(tmp_path, "torch", 'OSError("libtorch_cpu.so: cannot open shared object file")', COMMANDS[command])
    line = _one_line(proc)
    name = command.split()[0]
    assert line.startswith(f"megagspo {name}: error: importing 'torch' failed: OSError: libtorch_cpu.so: cannot "
                           "open shared object file; this is the Python environment"), line
    assert line.endswith("install the project's requirements (make install)"), line


def test_a_missing_package_is_named(tmp_path):
    proc = _cli(tmp_path, "transformers", 'ModuleNotFoundError("No module named \'transformers\'", name="transformers")',
                COMMANDS["train"])
    assert _one_line(proc).startswith("megagspo train: error: the Python package 'transformers' is not installed "
                                      "(No module named 'transformers')")


def test_an_unusable_locale_is_named_with_its_settings(tmp_path):
    proc = _cli(tmp_path, "megatron", 'locale.Error("unsupported locale setting")', COMMANDS["train"],
                LC_ALL="xx_YY.UTF-8")
    line = _one_line(proc)
    assert "importing 'megatron' failed: Error: unsupported locale setting; the locale or encoding is unusable " \
           "(LC_ALL='xx_YY.UTF-8'" in line and "set LANG=C.UTF-8" in line, line


def test_a_failure_in_the_projects_own_code_keeps_its_traceback(tmp_path):
    """Not the environment's: a bug, to be reported with its traceback."""
    proc = _cli(tmp_path, "megagspo.dry_run", 'RuntimeError("a bug")', COMMANDS["plan"])
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: a bug" in proc.stderr


@pytest.mark.parametrize("args,named", [
    (["train", "--config", "configs/tiny_cpu.yaml", "log.out_dir=/tmp/runs-\udcff"], "log.out_dir = '/tmp/runs-\\xff'"),
    (["plan", "--config", "configs/\udcfe.yaml"], "--config 'configs/\\xfe.yaml'"),
])
def test_a_path_that_cannot_be_decoded_is_named(args, named, capsys):
    from megagspo.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"megagspo {args[0]}: error: {named} is not UTF-8 text"), err


def test_output_never_fails_on_a_character_the_terminal_lacks(monkeypatch):
    from megagspo.environment import make_output_safe

    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    make_output_safe()
    print("approx KL(old‖θ) ± Δ")
    sys.stdout.flush()
    assert raw.getvalue() == b"approx KL(old\\u2016\\u03b8) \\xb1 \\u0394\n"
