"""The folder rules of docs/architecture.md, checked on the source: an AST walk over every import (and every
attribute read through a name `trainer`) of `megagspo/` and `moe/`, so that a change that breaks a rule fails
here instead of waiting for a review.

Each rule is a function of a source tree (`imports_of(root)`), and `test_planted_violations_are_found` plants one
violation of each rule in a scratch tree: a rule that stopped finding anything would fail there.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from typing import Dict, List

import pytest

from helpers import REPO

PACKAGES = ("megagspo", "moe")

# folder -> (imports it must not make, why: the "must not" column of docs/architecture.md)
FORBIDDEN = {
    "moe": (("megagspo",), "moe/ must not import megagspo"),
    "megagspo": (("megatron",), "megagspo/ reaches Megatron only through moe/"),
    "megagspo.algorithm": (("megagspo.trainer", "megagspo.rl", "megagspo.policy", "megagspo.rollout", "megagspo.checkpoint", "megagspo.kernels",
                            "megagspo.data", "megagspo.rewards", "moe", "megatron", "torch.distributed"),
                           "megagspo/algorithm/ is pure tensor math: no model, process group or run code"),
    "megagspo.rollout": (("megagspo.trainer", "megagspo.rl", "megagspo.policy"),
                         "megagspo/rollout/ must not run training code"),
    "megagspo.agent": (("megagspo.trainer", "megagspo.rl", "megagspo.policy", "megagspo.checkpoint"),
                       "megagspo/agent/ drives a rollout engine: it runs no training code"),
    "megagspo.rewards": (("megagspo.trainer", "megagspo.rl", "megagspo.policy", "megagspo.rollout", "moe", "megatron",
                          "torch.distributed"),
                         "megagspo/rewards/ are verifiers fn(response, answer): no model or process group"),
    **{module: (("megagspo.trainer", "megagspo.rl", "megagspo.policy", "megagspo.rollout", "megagspo.kernels",
                 "megagspo.rewards", "megagspo.checkpoint"),
                f"{module.replace('.', '/')}.py describes a run: it builds no component (registry names are checked "
                "in the preflight, where the components are built)")
       for module in ("megagspo.config", "megagspo.config_training", "megagspo.config_checks", "megagspo.config_moves")},
    "megagspo.rl": (("megagspo.trainer",), "megagspo/rl/ is the step: it never reaches up to the trainer"),
    "megagspo.policy": (("megagspo.rl", "megagspo.trainer"), "megagspo/policy/ is the model side: it runs no RL step"),
}
# Only the composition root's own callers may import it: no component sees the Trainer.
TRAINER_MODULE = "megagspo.trainer.trainer"
TRAINER_IMPORTERS = {"megagspo.commands", TRAINER_MODULE}

# Imports inside functions hide the dependency graph. Allowed: optional or slow-to-import third-party
# packages, each imported where it is used (a missing optional package is reported there, once).
GUARDED = ("megagspo._C", "megatron", "transformers", "tokenizers", "sglang", "transformer_engine", "apex", "matplotlib",
           "torch.utils.tensorboard", "math_verify", "pyarrow", "safetensors", "tqdm")
# Modules still importing project modules (megagspo.*, moe.*) inside functions, with how many such imports
# each may hold; a number may only go down. Other files, and any new file, import project modules at the top.
LAZY_PROJECT_IMPORTS_LEFT = {
    # the CLI imports only the standard library until its start-up signal guard is armed and the libraries are
    # quieted (megagspo.interrupts): its one lazy import is the commands module, which loads torch
    "megagspo.cli": 1,
    # the Trainer loads Megatron-Core and transformers (seconds); plan / export / ablate do not need it (every
    # other import there is at the top: they load torch anyway). This was megagspo.cli's one lazy import.
    "megagspo.commands": 1,
}


@dataclass(frozen=True)
class Import:
    module: str      # importing module, dotted
    target: str      # imported module, dotted and absolute
    line: int
    top: bool        # at module level (not inside a function)


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> List[str]:
    if not node.level:
        base = node.module or ""
    else:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    # `from pkg import sub` imports the submodule pkg.sub when there is one; both are recorded
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _sources(root: str) -> Dict[str, str]:
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    out[_module_name(root, path)] = path
    return out


def imports_of(root: str) -> List[Import]:
    """Every import statement of the packages under `root`, resolved to absolute module names."""
    found = []
    for module, path in _sources(root).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for sub in ast.walk(node):
                    sub._in_function = True  # noqa: SLF001 - a mark on the AST node only
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(module, is_package, node)
            else:
                continue
            top = not getattr(node, "_in_function", False)
            found.extend(Import(module, t, node.lineno, top) for t in targets)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# ------------------------------------------------------------------------------------------------- rules
def folder_rule_violations(root: str) -> List[str]:
    out = []
    for imp in imports_of(root):
        for folder, (banned, why) in FORBIDDEN.items():
            if _within(imp.module, folder) and any(_within(imp.target, b) for b in banned):
                out.append(f"{imp.module}:{imp.line} imports {imp.target}: {why}")
    return sorted(set(out))


def trainer_import_violations(root: str) -> List[str]:
    return sorted({f"{imp.module}:{imp.line} imports {TRAINER_MODULE}: only the composition root's callers "
                   f"({', '.join(sorted(TRAINER_IMPORTERS))}) may; components get explicit inputs"
                   for imp in imports_of(root)
                   if _within(imp.target, TRAINER_MODULE) and imp.module not in TRAINER_IMPORTERS})


def private_trainer_access_violations(root: str) -> List[str]:
    """Components never see the Trainer: outside the composition root's callers nothing takes a `trainer`
    argument or reads `trainer.<x>`; nowhere outside trainer.py (tests included) is `trainer._<x>` touched."""
    out = []
    files = dict(_sources(root))
    tests = os.path.join(root, "tests")
    if os.path.isdir(tests):
        files.update({f"tests.{name[:-3]}": os.path.join(tests, name) for name in os.listdir(tests)
                      if name.endswith(".py")})
    for module, path in files.items():
        if module == TRAINER_MODULE:
            continue
        component = not module.startswith("tests.") and module not in TRAINER_IMPORTERS
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
                if node.attr.startswith("_"):
                    out.append(f"{module}:{node.lineno} touches trainer.{node.attr}, a private attribute of the "
                               f"Trainer")
                elif component:
                    out.append(f"{module}:{node.lineno} reads trainer.{node.attr}: components take explicit "
                               f"inputs, never the Trainer")
            if component and isinstance(node, ast.arg) and node.arg == "trainer":
                out.append(f"{module}:{node.lineno} takes a `trainer` argument: components take explicit inputs")
    return sorted(set(out))


def import_cycles(root: str) -> List[List[str]]:
    """Strongly connected groups of the import graph among the project's modules (imports inside functions
    included: a circle hidden in a function is still a circle)."""
    modules = set(_sources(root))
    graph: Dict[str, set] = {m: set() for m in modules}
    for imp in imports_of(root):
        if imp.target in modules and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    # a package's __init__ running its submodules is not a cycle with them: edges into a parent package from
    # its own submodules are dropped (the parent is already loading)
    for m in graph:
        graph[m] = {t for t in graph[m] if not _within(m, t)}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def lazy_import_violations(root: str, allowance: Dict[str, int] = LAZY_PROJECT_IMPORTS_LEFT) -> List[str]:
    out, counts = [], {}
    lazy = [imp for imp in imports_of(root) if not imp.top]
    guarded = {(imp.module, imp.line) for imp in lazy if any(_within(imp.target, g) for g in GUARDED)}
    for imp in lazy:
        if (imp.module, imp.line) in guarded:
            continue
        if any(_within(imp.target, p) for p in PACKAGES):
            counts.setdefault(imp.module, set()).add(imp.line)
        elif imp.target.split(".")[0] not in _LAZY_OK:
            out.append(f"{imp.module}:{imp.line} imports {imp.target} inside a function: imports go at the top "
                       f"of the module (only the optional / heavy packages of GUARDED are imported where used)")
    for module, lines in counts.items():
        if len(lines) > allowance.get(module, 0):
            out.append(f"{module} imports project modules inside functions {len(lines)} times (lines "
                       f"{', '.join(map(str, sorted(lines)))}), allowed {allowance.get(module, 0)}: move them to "
                       f"the top of the module")
    return sorted(out)


# The standard library (and torch, numpy, yaml, always installed) may be imported where used: such an import
# hides no dependency between the project's modules.
_LAZY_OK = set(sys.stdlib_module_names) | {"torch", "numpy", "yaml"}


def long_functions_without_reason(root: str, limit: int = 60) -> List[str]:
    """Functions of more than `limit` lines of code (docstring, blank and comment lines not counted) without
    a `# Over 60 lines: <why>` comment on the line above them (or above their decorators)."""
    out = []
    for module, path in _sources(root).items():
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), filename=path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str)
            start = body[0].end_lineno + 1 if docstring else body[0].lineno
            code = [ln for ln in lines[start - 1:node.end_lineno] if ln.strip() and not ln.strip().startswith("#")]
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if len(code) > limit and not lines[first - 2].strip().startswith("# Over 60 lines"):
                out.append(f"{module}:{node.lineno} {node.name} has {len(code)} lines of code: split it, or say why "
                           f"not on the line above it (# Over 60 lines: ...)")
    return sorted(out)


# ------------------------------------------------------------------------------------------------- tests
def test_folder_rules_of_docs_architecture_hold():
    assert folder_rule_violations(REPO) == []


def test_no_component_sees_the_trainer():
    assert trainer_import_violations(REPO) == []
    assert private_trainer_access_violations(REPO) == []


def test_no_import_cycles():
    assert import_cycles(REPO) == []


def test_project_imports_are_at_module_top():
    assert lazy_import_violations(REPO) == []


def test_long_functions_say_why():
    assert long_functions_without_reason(REPO) == []


def test_the_rules_name_the_folders_of_docs_architecture():
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        doc = f.read()
    for folder in FORBIDDEN:
        name = folder.replace(".", "/")
        assert f"`{name}/`" in doc or f"`{name}.py`" in doc, f"{folder} has a rule here but no row in docs/architecture.md"


def _plant(root, files: Dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        for folder, _, names in os.walk(root / package):
            if "__init__.py" not in names:
                (root / folder / "__init__.py").write_text("")
    return str(root)


@pytest.mark.parametrize("files, check, expect", [
    ({"moe/model.py": "from megagspo.config import Config\n"}, folder_rule_violations, "moe/ must not import megagspo"),
    ({"megagspo/policy/megatron_policy.py": "def f():\n    from megatron.core import parallel_state\n"},
     folder_rule_violations, "reaches Megatron only through moe/"),
    ({"megagspo/algorithm/losses.py": "from ..kernels import fused\n", "megagspo/kernels/fused.py": ""},
     folder_rule_violations, "pure tensor math"),
    ({"megagspo/rollout/hf_engine.py": "import megagspo.policy.megatron_policy\n", "megagspo/policy/megatron_policy.py": ""},
     folder_rule_violations, "must not run training code"),
    ({"megagspo/config.py": "from megagspo.rl.sources import source_class\n", "megagspo/rl/sources.py": ""},
     folder_rule_violations, "it builds no component"),
    ({"megagspo/config.py": "from megagspo.rollout import available_engines\n", "megagspo/rollout/__init__.py": ""},
     folder_rule_violations, "registry names are checked in the preflight"),
    ({"megagspo/config.py": "from megagspo.kernels.policy_losses import check_loss_impl\n",
      "megagspo/kernels/policy_losses.py": ""}, folder_rule_violations, "it builds no component"),
    ({"megagspo/config_training.py": "from megagspo.rl.schedule import lr_at\n", "megagspo/rl/schedule.py": ""},
     folder_rule_violations, "config_training.py describes a run"),
    ({"megagspo/rl/step.py": "from megagspo.trainer.layout import check_layout\n", "megagspo/trainer/layout.py": ""},
     folder_rule_violations, "never reaches up to the trainer"),
    ({"megagspo/policy/models.py": "from megagspo.rl.step import RLStep\n", "megagspo/rl/step.py": ""},
     folder_rule_violations, "it runs no RL step"),
    ({"megagspo/trainer/sft.py": "from megagspo.trainer.trainer import Trainer\n",
      "megagspo/trainer/trainer.py": ""}, trainer_import_violations, "components get explicit inputs"),
    ({"megagspo/rl/step.py": "def score(trainer):\n    return trainer.reward_fn\n"},
     private_trainer_access_violations, "reads trainer.reward_fn"),
    ({"tests/test_x.py": "def test_x(trainer):\n    trainer._start_reference()\n"},
     private_trainer_access_violations, "touches trainer._start_reference"),
    ({"megagspo/a.py": "from megagspo import b\n", "megagspo/b.py": "def f():\n    from . import a\n"},
     lambda root: [" -> ".join(c) for c in import_cycles(root)], "megagspo.a -> megagspo.b"),
    ({"megagspo/data/datasets.py": "def load():\n    from megagspo.config import Config\n"},
     lazy_import_violations, "imports project modules inside functions 1 times"),
    ({"moe/long.py": "def f():\n" + "    x = 1\n" * 61}, long_functions_without_reason, "f has 61 lines of code"),
])
def test_planted_violations_are_found(tmp_path, files, check, expect):
    found = check(_plant(tmp_path, files))
    assert any(expect in line for line in found), found


def test_clean_planted_tree_has_no_findings(tmp_path):
    root = _plant(tmp_path, {"moe/parallel.py": "import torch\n", "megagspo/rl/step.py":
                             "from moe.parallel import ParallelDims\n\ndef collect(dims, engine):\n"
                             "    return dims.local_slice([])\n"})
    assert folder_rule_violations(root) == trainer_import_violations(root) == []
    assert private_trainer_access_violations(root) == lazy_import_violations(root) == import_cycles(root) == []
