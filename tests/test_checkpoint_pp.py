"""Checkpoints of a pipeline-parallel run, with real trainers on 2 gloo ranks at parallel.pipeline_parallel=2
(one layer per stage, micro-batches through Megatron's 1F1B schedule, Megatron's distributed optimizer):

- each stage writes its own layers: the first stage's shard file holds the embedding and layer 0, the last
  stage's the LM head and layer 1, under global layer numbers;
- the checkpoint resumes in one process at PP=1 (another layout): weights and optimizer state (fp32 masters, moments, steps) after
  loading equal the saved ones exactly;
- a PP=2 run stopped after step 2 (SIGTERM on the last stage: finish the step, checkpoint, exit 143) and
  resumed with checkpoint.resume=auto logs exactly the uninterrupted run's metrics and ends with its weights
  and moments.
"""

import json

import pytest

from multiprocess import run_distributed
from test_checkpoint_resume import ARGS
from test_checkpoint_tp import (DATA, _assert_equal, _reload_body, stopped_and_resumed_equals_uninterrupted,
                                uninterrupted_run)

PP2 = [*ARGS[2:], "rl.steps=4", "checkpoint.every_steps=2", "parallel.pipeline_parallel=2"]


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """The uninterrupted PP=2 run: 4 RL steps, its run folder, and its final gathered state (both stages)."""
    run_dir, full, opt_full, (first, last) = uninterrupted_run(tmp_path_factory.mktemp("pp2"), PP2)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last
    return run_dir, full, opt_full


@pytest.mark.multiprocess
def test_pp2_stages_write_their_layers_and_resume_at_pp1(pp2_run):
    from moe.dist_checkpoint import read_metadata_safely

    run_dir, full, opt_full = pp2_run
    ckpt = run_dir / "checkpoints" / "step_000004"
    state = json.load(open(ckpt / "trainer_state.json"))
    assert state["world"] == 2 and state["layout"]["pipeline_parallel"] == 2
    md = read_metadata_safely(str(ckpt / "model"))
    files = {}
    for idx, info in md.storage_data.items():
        files.setdefault(idx.fqn, set()).add(info.relative_path)
    assert files["embedding.word_embeddings.weight"] == {"__0_0.distcp"}
    assert files["output_layer.weight"] == {"__1_0.distcp"}
    for layer, shard in ((0, "__0_0.distcp"), (1, "__1_0.distcp")):
        held = [f for k, f in files.items() if k.startswith(f"decoder.layers.{layer}.")]
        assert held and set().union(*held) == {shard}, (layer, held)

    (got_full, got_opt, shapes), = run_distributed(_reload_body, world_size=1, timeout_s=240,
                                                   args=(str(ckpt), [*DATA, "parallel.pipeline_parallel=1"]))
    assert shapes == {n: tuple(t.shape) for n, t in full.items()}
    assert len(opt_full) == 4 * len(full)  # fp32 master, moments, step
    _assert_equal(got_full, full, "PP=1 weights")
    _assert_equal(got_opt, opt_full, "PP=1 optimizer state")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_run_stopped_and_resumed_equals_uninterrupted(pp2_run, tmp_path):
    stopped_and_resumed_equals_uninterrupted(*pp2_run, tmp_path, PP2)
