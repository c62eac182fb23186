"""The memory planner's arithmetic, pinned against cases computed by hand (in the comments)."""

import dataclasses

import pytest

from megagspo.planner import GIB, PlanError, PlanInputs, _stage_terms, parameter_counts, plan_memory, require_fit
from moe.architecture import Qwen3MoeArchitecture
from moe.parallel import LayoutError, ParallelLayout

from helpers import tiny_arch

TINY = tiny_arch("planner")
QWEN3_30B_A3B = Qwen3MoeArchitecture(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                     intermediate_size=6144, rope_theta=1e6)


def test_parameter_counts_by_hand():
    counts = parameter_counts(TINY)
    # embedding 100*8; attention 8*(2+2)*4 qkv + 2*4*8 proj + 2*4 qk-norm + 2*8 norms = 216
    assert (counts.embedding, counts.output_layer, counts.attention_per_layer) == (800, 800, 216)
    assert (counts.router_per_layer, counts.experts_per_layer, counts.final_norm) == (32, 576, 8)
    # 800 + 800 + 8 + 2*216 + 2*(32 + 576) = 3256; active drops 2 of 4 experts in both layers: -2*288
    assert counts.total(TINY) == 3256
    assert counts.active(TINY) == 2680


def test_qwen3_30b_a3b_has_30_5b_total_and_3_3b_active_parameters():
    counts = parameter_counts(QWEN3_30B_A3B)
    assert 30.4e9 < counts.total(QWEN3_30B_A3B) < 30.6e9
    assert 3.2e9 < counts.active(QWEN3_30B_A3B) < 3.4e9


def test_ep2_plan_by_hand():
    inputs = PlanInputs(world_size=2, layout=ParallelLayout(expert_parallel=2), micro_batch_tokens=10,
                        fused_logprob=True, gpu_memory_gib=1.0, reserve_gib=0.0)
    plan = plan_memory(TINY, inputs)
    got = {name: round(gib * GIB) for name, gib in plan.terms_gib.items()}
    # dense on this rank: 2*216 + 2*32 routers + 800 + 800 + 8 = 2104; experts: 2 layers * 576 / EP 2 = 576
    assert got["weights (bf16)"] == 2 * (2104 + 576)
    assert got["gradients (fp32 main grad)"] == 4 * (2104 + 576)
    # dense sharded over DP=2, experts over expert-DP=1
    assert got["optimizer (fp32 master + Adam, sharded over DP)"] == 12 * 2104 // 2 + 12 * 576
    # attention 2*(16 + 16 + 8) + 4*2 = 88; MoE 4*8 + 4*4 + 2*2*(8 + 18) = 152; 2 layers, 10 tokens
    assert got["activations"] == (2 * 88 + 2 * 152) * 10
    assert got["log-prob: logits (bf16)"] == 2 * 100 * 10
    assert got["log-prob: fused kernel stats"] == 16 * 10
    assert round(plan.total_gib * GIB) == 5360 + 10720 + 19536 + 4800 + 2000 + 160
    assert plan.stage == "only" and plan.fits


def test_fp32_plan_by_hand():
    """The EP=2 case above in fp32: 4 B weights, the optimizer holds Adam's m and v only (the fp32 weights are
    their own master), activations and logits at 4 B (the softmax lse and router logits are fp32 either way)."""
    inputs = PlanInputs(world_size=2, layout=ParallelLayout(expert_parallel=2), micro_batch_tokens=10,
                        fused_logprob=True, gpu_memory_gib=1.0, reserve_gib=0.0, precision="fp32")
    got = {name: round(gib * GIB) for name, gib in plan_memory(TINY, inputs).terms_gib.items()}
    assert got["weights (fp32)"] == 4 * (2104 + 576)
    assert got["gradients (fp32 main grad)"] == 4 * (2104 + 576)
    assert [v for k, v in got.items() if k.startswith("optimizer")] == [8 * 2104 // 2 + 8 * 576]
    # attention 4*(16 + 16 + 8) + 4*2 = 168; MoE 4*16 + 4*4 + 2*4*(8 + 18) = 288; 2 layers, 10 tokens
    assert got["activations"] == (2 * 168 + 2 * 288) * 10
    assert got["log-prob: logits (fp32)"] == 4 * 100 * 10


@pytest.mark.parametrize("recompute, expected", [
    ("none", (2 * 88 + 2 * 152) * 10),
    # selective: attention drops the lse, 88 - 4*2 = 80; an MoE layer keeps 2 B * 2h = 32; one MoE layer's other
    # 152 - 32 = 120 B are live again while it is recomputed
    ("selective", (2 * 80 + 2 * 32 + 120) * 10),
    # full: each layer keeps its input, 2 B * h = 16; one whole layer (88 + 152) is live again in its recompute
    ("full", (2 * 16 + 88 + 152) * 10),
])
def test_activation_recompute_by_hand(recompute, expected):
    inputs = PlanInputs(world_size=2, layout=ParallelLayout(expert_parallel=2), micro_batch_tokens=10,
                        gpu_memory_gib=1.0, reserve_gib=0.0, recompute=recompute)
    got = {name: round(gib * GIB) for name, gib in plan_memory(TINY, inputs).terms_gib.items()}
    assert got["activations"] == expected
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full"):
        PlanInputs(world_size=2, layout=ParallelLayout(), micro_batch_tokens=10, recompute="partial")


def test_naive_logprob_and_routing_replay_terms():
    inputs = PlanInputs(world_size=2, layout=ParallelLayout(tensor_parallel=2), micro_batch_tokens=10,
                        num_micro_batches=3, fused_logprob=False, routing_replay=True)
    arch = dataclasses.replace(TINY, num_key_value_heads=2)  # TP=2 needs KV heads divisible by 2
    got = {name: round(gib * GIB) for name, gib in plan_memory(arch, inputs).terms_gib.items()}
    assert got["log-prob: fp32 log-softmax + its gradient"] == 8 * 50 * 10  # V/TP = 50
    assert got["routing replay buffer"] == 10 * 3 * 2 * 2 * 1  # tokens * micro-batches * layers * k * uint8


def test_pipeline_plan_picks_the_busier_stage():
    inputs = PlanInputs(world_size=2, layout=ParallelLayout(pipeline_parallel=2), micro_batch_tokens=10,
                        num_micro_batches=4)
    plan = plan_memory(TINY, inputs)
    first = _stage_terms(TINY, inputs, True, False)
    last = _stage_terms(TINY, inputs, False, True)
    assert "log-prob: logits (bf16)" in last and "log-prob: logits (bf16)" not in first
    busier, terms = ("first", first) if sum(first.values()) >= sum(last.values()) else ("last", last)
    assert plan.stage == busier
    assert plan.total_gib == pytest.approx(sum(terms.values()) / GIB)


def test_first_pipeline_stage_holds_min_pp_micro_batches_of_one_update_in_flight():
    """1F1B: the first stage runs up to PP forwards before its first backward, within one optimizer step's
    schedule call; a later stage, and any stage without pipelining, holds one micro-batch."""
    def activations(pp, per_update, first=True):
        inputs = PlanInputs(world_size=pp, layout=ParallelLayout(pipeline_parallel=pp), micro_batch_tokens=10,
                            num_micro_batches=8, micro_batches_per_update=per_update)
        return _stage_terms(TINY, inputs, first, not first)["activations"]

    one = activations(2, 1)
    assert activations(2, 4) == 2 * one  # min(PP=2, 4) in flight
    assert activations(2, 4, first=False) == one
    # without pipelining one stage holds both of the 2 layers (one micro-batch in flight): twice one stage
    assert activations(1, 4) == 2 * one
    # 0 = every micro-batch of the rollout batch in one update: min(PP, 8)
    assert activations(2, 0) == 2 * one


def test_a_recipe_that_cannot_fit_is_refused_naming_the_largest_term():
    inputs = PlanInputs(world_size=8, layout=ParallelLayout(expert_parallel=8), micro_batch_tokens=32768,
                        gpu_memory_gib=80.0)
    with pytest.raises(PlanError, match=r"largest term is 'activations'"):
        require_fit(plan_memory(QWEN3_30B_A3B, inputs))


def test_layout_that_does_not_divide_is_an_error():
    with pytest.raises(LayoutError, match="num_experts=4 is not divisible by expert_parallel=3"):
        plan_memory(TINY, PlanInputs(world_size=3, layout=ParallelLayout(expert_parallel=3), micro_batch_tokens=8))
