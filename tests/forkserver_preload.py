"""Imported once by run_distributed's fork server (tests/multiprocess.py), never by a test: the modules the
children's test bodies import (torch, Megatron-Core, transformers, sympy through the math reward, the project),
so that a forked child starts with them loaded instead of paying a fresh interpreter's seconds of imports.

The server only imports: it builds no tensor, starts no thread (checked by
test_multiprocess_harness.test_fork_server_is_single_threaded) and initialises no process group, so what a child
inherits is what a spawned child has after its own imports. A module that fails to import here (a file being
edited, an optional package missing) is skipped: the child imports it again and the test reports the error.
"""

import importlib

MODULES = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "moe.model",
    "moe.optimizer",
    "moe.parallel",
    "moe.dist_checkpoint",
    "moe.hf_checkpoint",
    "moe.sharding",
    "megagspo.trainer.trainer",
    "megagspo.rl.producer",
    "megagspo.rollout.hf_engine",
    "megagspo.rollout.sglang.engine",
    "megagspo.rollout.weight_sync",
    "megagspo.rewards.math_answers",
    "megagspo.agent.runner",
    "megagspo.data.tokenizer",
    "pytest",
    "multiprocess",
    "helpers",
    "devices",
)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - the child imports it again and its test fails with the real error
        pass
