"""The planner's log-prob terms follow the trainer's path (model.logprob_path): by hand on a tiny model, and
on the Qwen3-30B-A3B recipe through the dry run (no [tokens, V/TP] logits on the hidden path)."""

import dataclasses
import os

import pytest

from megagspo.planner import GIB, PlanInputs, plan_memory
from moe.parallel import ParallelLayout

from helpers import REPO, tiny_arch

TINY = tiny_arch("planner", num_key_value_heads=2)


def _terms(layout, precision, path, tokens=10, chunk=4):
    inputs = PlanInputs(world_size=2, layout=layout, micro_batch_tokens=tokens, precision=precision,
                        logprob_path=path, logprob_chunk_tokens=chunk, gpu_memory_gib=1.0, reserve_gib=0.0)
    return {name: round(gib * GIB) for name, gib in plan_memory(TINY, inputs).terms_gib.items()}


def test_hidden_path_terms_by_hand():
    # EP=2, bf16, 10 tokens, chunks of 4: V/TP = 100, h = 8
    got = _terms(ParallelLayout(expert_parallel=2), "bf16", "hidden")
    assert not any(name.startswith("log-prob: logits") for name in got)
    # d weight goes into the fp32 main-grad buffer (counted under gradients): no accumulator term
    assert [k for k in got if k.startswith("log-prob")] == ["log-prob: LM-head input (bf16, full sequence)",
                                                            "log-prob: one chunk's logits (bf16)",
                                                            "log-prob: fused kernel stats"]
    assert got["log-prob: LM-head input (bf16, full sequence)"] == 2 * 8 * 10
    assert got["log-prob: one chunk's logits (bf16)"] == 2 * 100 * 4
    assert got["log-prob: fused kernel stats"] == 16 * 10
    # TP=2: the vocab shard halves the chunk and the accumulator; the LM-head input is the full sequence
    got = _terms(ParallelLayout(tensor_parallel=2), "fp32", "hidden", chunk=1024)
    assert got["log-prob: LM-head input (fp32, full sequence)"] == 4 * 8 * 10
    assert got["log-prob: one chunk's logits (fp32)"] == 4 * 50 * 10  # the chunk is capped at the tokens
    assert got["log-prob: fused kernel stats"] == 32 * 10
    # the rest of the plan does not depend on the path
    logits = _terms(ParallelLayout(tensor_parallel=2), "fp32", "logits", chunk=1024)
    assert {k: v for k, v in got.items() if not k.startswith("log-prob")} == \
        {k: v for k, v in logits.items() if not k.startswith("log-prob")}


def test_hidden_path_needs_the_fused_kernel():
    with pytest.raises(ValueError, match="logprob_path 'hidden' runs the chunked log-prob kernel"):
        PlanInputs(world_size=1, layout=ParallelLayout(), micro_batch_tokens=10, fused_logprob=False,
                   logprob_path="hidden")
    with pytest.raises(ValueError, match="logprob_path must be one of hidden, logits"):
        PlanInputs(world_size=1, layout=ParallelLayout(), micro_batch_tokens=10, logprob_path="chunks")


def test_recipe_plan_follows_the_recipes_path():
    from megagspo.config import deferred_path_checks, load_config
    from megagspo.dry_run import dry_run

    path = os.path.join(REPO, "configs/qwen3_30b_a3b_gspo.yaml")
    plans = {}
    for logprob_path in ("hidden", "logits"):
        with deferred_path_checks() as missing:
            cfg = load_config(path, [f"model.logprob_path={logprob_path}"])
        plans[logprob_path] = dry_run(cfg, missing_paths=missing, require_fitting=False).plan
    hidden, logits = plans["hidden"].terms_gib, plans["logits"].terms_gib
    assert not any(k.startswith("log-prob: logits") for k in hidden)
    # bf16 at TP=1: the 2.32 GiB of logits give way to one chunk (0.29 GiB) and the LM-head input (0.03 GiB)
    log_prob = lambda terms: sum(v for k, v in terms.items() if k.startswith("log-prob"))  # noqa: E731
    assert log_prob(hidden) == pytest.approx(log_prob(logits) - 2.32 + 0.29 + 0.03, abs=0.01)
    assert sum(hidden.values()) < sum(logits.values()) - 1.9
