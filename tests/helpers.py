"""Helpers the test modules share (one copy each): the repository root, fresh seeds, the scaled closeness
check, the tiny architectures and the tiny trainer.

Plain functions, not pytest fixtures: most model tests build their model inside a spawned child
(tests/multiprocess.run_distributed), which imports this module but where no fixture reaches. What runs inside
such a child with Megatron's groups (the CPU shim, the groups, Megatron's RNG) is in tests/devices.py."""

from __future__ import annotations

import os
from typing import Callable

import torch

from moe.architecture import Qwen3MoeArchitecture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RECIPE = os.path.join(REPO, "configs/tiny_cpu.yaml")


def fresh_seed() -> int:
    """A fresh seed per test, printed; MEGAGSPO_TEST_SEED=N reruns a failure's seed."""
    seed = int(os.environ.get("MEGAGSPO_TEST_SEED") or torch.randint(0, 2**20, ()).item())
    print(f"seed {seed}")
    return seed


def reseed_torch() -> int:
    """torch's global generator seeded with a fresh seed in [0, 2**31 - 1), returned for failure messages."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    return seed


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float, atol_scale: float,
                        atol_floor: float = 1e-7) -> None:
    """torch.testing.assert_close with an absolute tolerance relative to the reference's largest value
    (atol = atol_scale * max|expected| + atol_floor): float reductions in another order differ by a few ulps
    of the largest value, not of each element. `what` starts the failure message."""
    atol = atol_scale * float(expected.abs().max()) + atol_floor
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def scaled_close(*, rtol: float, atol_scale: float, atol_floor: float = 1e-7) -> Callable[..., None]:
    """assert_close_scaled with a module's tolerances fixed: `_close = scaled_close(rtol=1e-5, atol_scale=2e-6)`,
    then `_close(actual, expected, what)`."""
    def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        assert_close_scaled(actual, expected, what, rtol=rtol, atol_scale=atol_scale, atol_floor=atol_floor)
    return close


# The tiny Qwen3-MoE shapes the tests build, by name; a test passes the sizes it needs different as overrides of
# tiny_arch (every field not named keeps Qwen3MoeArchitecture's default, e.g. max_position_embeddings=40960).
TINY_ARCHS = {
    # two MoE layers of 4 experts, top-2, GQA 4 / 2 heads of 8: the Megatron model of most layout tests
    "moe": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=64),
    # the same with layer 0 dense (a SwiGLU MLP 24 wide, TP-split gate / up): the mixed models Qwen3 allows
    "mixed": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=64, mlp_only_layers=(0,), intermediate_size=24),
    # one layer, hidden 16, 4 experts: the fastest to build (optimizer and precision tests)
    "micro": dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=16),
    # one layer around an attention module tested alone (heads, kv heads and head_dim overridden per test)
    "attention": dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=2,
                      num_experts_per_tok=2),
    # the planner's arithmetic checked by hand: every size small and most of them distinct
    "planner": dict(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=4, moe_intermediate_size=6, num_experts=4, num_experts_per_tok=2),
}


def tiny_arch(name: str = "moe", **overrides) -> Qwen3MoeArchitecture:
    """The tiny architecture `name` of TINY_ARCHS with `overrides` (field=value) applied, validated."""
    if name not in TINY_ARCHS:
        raise KeyError(f"no tiny architecture {name!r}; known: {', '.join(TINY_ARCHS)}")
    return Qwen3MoeArchitecture(**{**TINY_ARCHS[name], **overrides})


def tiny_trainer(overrides, **trainer_kwargs):
    """A Trainer of configs/tiny_cpu.yaml with `overrides` (key=value strings), quiet; `trainer_kwargs` go to
    Trainer (reward_fn=, adamw_class=, ...). Imported here, not at the top: the Trainer loads Megatron-Core and
    transformers (seconds), which the tests that only need REPO or a seed do not."""
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    return Trainer(load_config(TINY_RECIPE, overrides), quiet=True, **trainer_kwargs)


# The child of CliRuns: reads one JSON argv per line on stdin, runs `megagspo.cli.main(argv)`, answers one JSON line
# {"rc", "stdout", "stderr"} on the pipe that was its stdout (fd 1 then points at its stderr, so that a stray write
# cannot corrupt an answer). sys.stdout / sys.stderr stay the same objects for good, each sending a run's text to
# that run's buffer: a handler that kept the stream of an earlier run (logging's) writes to the current one.
_CLI_RUNS_CHILD = r"""
import io, json, os, sys, traceback

class Captured(io.TextIOBase):
    def __init__(self, fd):
        self.fd, self.text = fd, io.StringIO()
    encoding = "utf-8"
    def writable(self):
        return True
    def write(self, s):
        return self.text.write(s)
    def fileno(self):
        return self.fd
    def isatty(self):
        return False
    def take(self):
        text, self.text = self.text.getvalue(), io.StringIO()
        return text

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout, sys.stderr = Captured(1), Captured(2)
from megagspo.cli import main
for line in sys.stdin:
    try:
        rc = main(json.loads(line))
    except SystemExit as exc:  # argparse's errors
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a fresh process would print it and exit 1
        traceback.print_exc()
        rc = 1
    answers.write(json.dumps({"rc": rc, "stdout": sys.stdout.take(), "stderr": sys.stderr.take()}) + "\n")
    answers.flush()
"""


class CliRuns:
    """`python -m megagspo.cli ARGV` runs made one after another in ONE child process (cwd REPO, env `env`): a run
    costs its own work, not again the seconds of a fresh process's imports and start-up. For runs that are only
    read afterwards (metrics, output, files); a run to be signalled or killed needs a process of its own.
    run(argv) takes the CLI's arguments (or a whole `python -m megagspo.cli ...` command line) and returns a
    subprocess.CompletedProcess. A run here logs and writes what a fresh process's run does (the CLI keeps no state
    between runs); what a process prints once is printed by its first run only (the 'logged patches' line, a
    Python warning, a Megatron log line), so a command whose every stderr line is checked gets a process of its
    own. A run past `timeout` kills the child: that run and the later ones fail."""

    def __init__(self, env: dict, log_path: str):
        import subprocess
        import sys

        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _CLI_RUNS_CHILD], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)

    def run(self, argv: list, timeout: float = 600):
        import json
        import subprocess
        import threading

        argv = list(argv)
        if argv[1:3] == ["-m", "megagspo.cli"]:
            argv = argv[3:]
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            self._log.flush()
            with open(self.log_path) as f:
                raise AssertionError(f"the CliRuns child ended (exit {self.proc.wait()}; killed after {timeout} s if "
                                     f"it ran that long) in {argv}: {f.read()[-4000:]}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(argv, answer["rc"], answer["stdout"], answer["stderr"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a child that does not end on EOF is killed
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
