"""Cluster scale without a GPU: every recipe in configs/ passes `megagspo train --dry-run`, `megagspo plan`
refuses what cannot fit or divide, and the launch script runs the tiny recipe with 2 processes on CPU."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, CliRuns
from multiprocess import cpu_pinned_env

RECIPES = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "configs", "*.yaml")))
# The tiny recipe, shortened to seconds (as in tests/test_train_short.py).
SHORT = ["sft.steps=2", "sft.batch_size=16", "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4",
         "rl.mini_batches=2", "rl.eval_every=2", "data.train_size=200", "data.eval_size=20", "log.progress=false"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's `megagspo` commands: a command costs its work, not a fresh start-up."""
    runs = CliRuns(cpu_pinned_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _megagspo(cli, *args, timeout=180):
    return cli.run(list(args), timeout=timeout)


def test_recipes_exist_for_the_cluster_and_the_cpu():
    names = {os.path.basename(p) for p in RECIPES}
    assert {"tiny_cpu.yaml", "qwen3_30b_a3b_gspo.yaml", "qwen3_30b_a3b_gspo_16gpu.yaml",
            "qwen3_30b_a3b_gspo_16gpu_pp2.yaml", "qwen3_30b_a3b_grpo_r2.yaml", "qwen3_30b_a3b_grpo_no_replay.yaml"} <= names


def _generated_inputs(recipe: str, tmp_path) -> list:
    """Overrides pointing a recipe whose inputs a tool generates (tiny_hf_cpu: megagspo.tools.tiny_hf_model)
    at a freshly generated copy; [] for the others."""
    if os.path.basename(recipe) != "tiny_hf_cpu.yaml":
        return []
    from megagspo.tools.tiny_hf_model import build_tiny_hf_model

    kit = build_tiny_hf_model(str(tmp_path / "tiny_hf_model"))
    return [f"model.init_from={kit['model']}", f"data.train_path={kit['train']}", f"data.eval_path={kit['eval']}"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_passes_dry_run(cli, recipe, tmp_path):
    proc = _megagspo(cli, "train", "--dry-run", "--config", recipe, *_generated_inputs(recipe, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is valid for" in proc.stdout
    assert "total (" in proc.stdout  # the memory plan was printed


def test_30b_gspo_recipe_has_the_paper_settings_and_a_plan_that_fits(cli):
    proc = _megagspo(cli, "plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "30.53B parameters, 3.35B active" in proc.stdout
    assert "8 ranks = TP 1 x PP 1 x EP 8" in proc.stdout
    import yaml

    with open(os.path.join(REPO, "configs/qwen3_30b_a3b_gspo.yaml")) as f:
        rl = yaml.safe_load(f)["rl"]
    loss = rl["loss"]
    assert (loss["name"], loss["clip_low"], loss["clip_high"], rl["batch"]["mini_batches"], rl["kl"]["coef"]) == \
        ("gspo", 3e-4, 4e-4, 4, 0.0)


def test_16gpu_pp2_recipe_differs_from_the_ep16_one_only_in_layout_and_plans_its_bubble(cli):
    import yaml

    with open(os.path.join(REPO, "configs/qwen3_30b_a3b_gspo_16gpu.yaml")) as f:
        ep16 = yaml.safe_load(f)
    with open(os.path.join(REPO, "configs/qwen3_30b_a3b_gspo_16gpu_pp2.yaml")) as f:
        pp2 = yaml.safe_load(f)
    assert pp2["parallel"] == dict(ep16["parallel"], pipeline_parallel=2, expert_parallel=8)
    assert pp2["rl"]["batch"].pop("micro_batch_size") == 2
    for cfg in (ep16, pp2):
        cfg.pop("name"), cfg.pop("parallel")
    assert pp2 == ep16
    proc = _megagspo(cli, "plan", "--config", "configs/qwen3_30b_a3b_gspo_16gpu_pp2.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 ranks = TP 1 x PP 2 x EP 8 (dense data-parallel 8)" in proc.stdout
    # 32 prompts x 8 / 8 DP ranks / 4 mini-batches = 8 sequences -> 4 micro-batches of 2: bubble 1 / (4 + 1)
    assert "pipeline: 2 stages, 4 micro-batch(es) per mini-batch" in proc.stdout and "bubble 20%" in proc.stdout
    assert "total (first stage)" in proc.stdout


def test_grpo_arms_differ_only_in_routing_replay():
    import yaml

    with open(os.path.join(REPO, "configs/qwen3_30b_a3b_grpo_r2.yaml")) as f:
        with_replay = yaml.safe_load(f)
    with open(os.path.join(REPO, "configs/qwen3_30b_a3b_grpo_no_replay.yaml")) as f:
        without = yaml.safe_load(f)
    assert with_replay["rl"].pop("routing_replay") == "r2" and without["rl"].pop("routing_replay") == "none"
    with_replay.pop("name"), without.pop("name")
    assert with_replay == without


def test_plan_refuses_a_recipe_that_cannot_fit_naming_the_largest_term(cli):
    proc = _megagspo(cli, "plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml", "parallel.gpu_memory_gib=40")
    assert proc.returncode == 2
    assert "largest term is 'optimizer" in proc.stderr or "largest term is 'activations'" in proc.stderr, proc.stderr


def test_plan_refuses_a_layout_that_does_not_divide(cli):
    proc = _megagspo(cli, "plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml", "parallel.expert_parallel=3",
                     "parallel.world_size=9", "rl.prompts_per_step=18")
    assert proc.returncode == 2
    assert "num_experts=128 is not divisible by parallel.expert_parallel=3" in proc.stderr, proc.stderr


def test_layout_is_checked_against_the_init_from_folders_architecture(tmp_path):
    """No model.arch_file: the experts, heads, layers and vocabulary that TP / EP / PP must divide are those of
    model.init_from's config.json (what the model is built from), not the recipe's defaults (4 experts)."""
    from megagspo.config import ConfigError, load_config
    from megagspo.dry_run import dry_run
    from megagspo.tools.tiny_hf_model import TinyHFSpec, build_tiny_hf_model

    def recipe(kit, *extra):
        return load_config(os.path.join(REPO, "configs/tiny_hf_cpu.yaml"), [
            f"model.init_from={kit['model']}", f"data.train_path={kit['train']}", f"data.eval_path={kit['eval']}",
            "parallel.world_size=8", "rl.prompts_per_step=8", *extra])

    eight = build_tiny_hf_model(str(tmp_path / "eight"), TinyHFSpec(num_experts=8, train_rows=8, eval_rows=2))
    report = dry_run(recipe(eight, "parallel.expert_parallel=8"))
    assert report.world_size == 8
    six = build_tiny_hf_model(str(tmp_path / "six"), TinyHFSpec(num_experts=6, train_rows=8, eval_rows=2))
    with pytest.raises(ConfigError) as err:
        dry_run(recipe(six, "parallel.expert_parallel=8"))
    assert f"model.init_from = {six['model']!r} (its config.json): num_experts=6 is not divisible by " \
           "parallel.expert_parallel=8" in str(err.value), err.value
    # EP=2 divides 4 (the recipe's default) and 6 alike; EP=4 divides the default but not the folder's 6
    dry_run(recipe(six, "parallel.expert_parallel=2"))
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by parallel.expert_parallel=4"):
        dry_run(recipe(six, "parallel.expert_parallel=4"))
    # the trainer's own preflight shares the check (world 8, no process started)
    from megagspo.trainer.layout import check_layout

    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by parallel.expert_parallel=4"):
        check_layout(recipe(six, "parallel.expert_parallel=4"), 8)


def test_dry_run_reports_cluster_paths_it_cannot_see(cli):
    proc = _megagspo(cli, "train", "--dry-run", "--config", "configs/qwen3_30b_a3b_gspo.yaml")
    assert "not on this machine (checked when the run starts): data.train_path = /data/gsm8k/main/train-00000-of-00001.parquet" in proc.stdout


@pytest.mark.multiprocess
def test_single_node_launcher_runs_the_tiny_recipe_with_two_processes(tmp_path):
    # 2 gloo ranks on the CPU, also on a GPU host (NCCL cannot run two ranks on one GPU)
    env = cpu_pinned_env(NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PYTHON=sys.executable,
                         PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", "launch/torchrun_single_node.sh", "configs/tiny_cpu.yaml", *SHORT,
                           f"log.out_dir={tmp_path}", "name=launched", "threads=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(tmp_path / "launched" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert any("reward/mean" in row for row in rows)
