"""The engine-trainer gap routing replay exists for, made and measured (issue 47):

- rollout.engine_dtype: the embedded engine computes in its own precision (fp32 / bf16 / fp16 / fp8_sim) while the
  trainer keeps its own; fp8_sim rounds the routers and experts through float8_e4m3fn with per-tensor scales as it
  loads the trainer's exact weights; SGLang gets the same dial as launch arguments;
- the route gap (rl.route_gap): the engine's top-k sets against the trainer's at the same weights, and under replay
  the replayed routes against the live routers'; the field's token mismatch metrics;
- the built-in checks: an fp32 engine at one update per batch shows no gap and R2 = R3 = no replay, bit for bit;
  R2 replays exactly the live routes on the first mini-batch; bf16 and fp8_sim engines show a gap that R3 narrows
  (k3 KL) on the same batch; no sampled token is given a filler route.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import REPO, CliRuns
from multiprocess import cpu_pinned_env

# a small MoE with routing near its top-k boundaries (the ablation testbed's experts; 2 layers), one update per
# batch, staleness 0: pi_old is the policy whose weights the engine sampled with
RUN = ["sft.steps=12", "sft.batch_size=32", "reward.name=digit_match", "rl.steps=2", "rl.batch.prompts_per_step=8",
       "rl.batch.group_size=4", "rl.batch.mini_batches=1", "rl.eval.every=100", "rl.eval.samples=0",
       "data.train_size=200", "data.eval_size=8", "model.num_experts=16", "model.num_experts_per_tok=4",
       "model.moe_intermediate_size=32", "model.router_aux_loss_coef=1.0", "rl.optim.lr=0.002", "threads=1",
       "log.progress=false", "log.plots=false", "log.tensorboard=false", "log.save_checkpoint=false",
       "checkpoint.every_steps=0"]
UNTIMED = ("time/", "throughput/", "memory/")


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's runs (each `megagspo train`): a run costs its training, not a fresh start-up."""
    env = cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = CliRuns(env, str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _rl_rows(cli, tmp_path, name, *extra):
    proc = cli.run(["train", "--config", "configs/tiny_cpu.yaml", *RUN, *extra, f"name={name}",
                    f"log.out_dir={tmp_path}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED)} for r in rows if r.get("phase") == "rl"]


def test_fp32_engine_on_policy_has_no_gap_and_replay_changes_nothing(cli, tmp_path):
    """The CPU engine samples with the trainer's fp32 weights: its routes are the trainer's (route gap 0), so
    R2 and R3 replay the routes the router picks anyway and every metric equals the run without replay; R2's
    replayed routes equal the live ones (one mini-batch: the weights of its recompute)."""
    plain = _rl_rows(cli, tmp_path, "none", "rl.route_gap=true")
    assert all(r["mismatch/route_pair_frac"] == 0.0 == r["mismatch/route_token_frac"] for r in plain)
    assert all(r["mismatch/k3_kl"] < 1e-9 for r in plain), [r["mismatch/k3_kl"] for r in plain]  # fp32 rounding
    assert any(r["moe/expert_volatility"] > 0 for r in plain), "the test needs routes that move in an update"
    for arm in ("r2", "r3"):
        rows = _rl_rows(cli, tmp_path, arm, f"rl.routing_replay={arm}", "rl.route_gap=true")
        assert [r["replay/route_override_pair_frac"] for r in rows] == [0.0] * len(rows)
        assert [{k: v for k, v in r.items() if not k.startswith("replay/")} for r in rows] == plain, arm


@pytest.mark.parametrize("engine_dtype", ["bf16", "fp8_sim"])
def test_a_lower_precision_engine_shows_a_gap_that_r3_narrows(cli, tmp_path, engine_dtype):
    """bf16 / fp8_sim engine against the fp32 trainer: some (token, layer) top-k sets differ between the engine and
    the trainer at the same weights; on the same first batch (same seed, same engine), replaying the engine's
    routes (R3) brings pi_old closer to the engine: a lower k3 KL and |d logp| than without replay, and the update
    overrides the live routers' choices."""
    plain = _rl_rows(cli, tmp_path, "none", f"rollout.engine_dtype={engine_dtype}")
    r3 = _rl_rows(cli, tmp_path, "r3", f"rollout.engine_dtype={engine_dtype}", "rl.routing_replay=r3")
    first, first_r3 = plain[0], r3[0]
    assert first["mismatch/route_pair_frac"] > 0 and first["mismatch/route_token_frac"] > 0
    assert first["mismatch/route_token_frac"] >= first["mismatch/route_pair_frac"]
    assert first_r3["mismatch/route_pair_frac"] == first["mismatch/route_pair_frac"]  # the same batch, the same gap
    # the update replays the engine's routes where the live routers would choose otherwise (each router's live
    # choice sees the hidden states the replayed layers before it made, so this is near the gap, not equal to it)
    assert first_r3["replay/route_override_pair_frac"] > 0
    assert first_r3["mismatch/k3_kl"] < first["mismatch/k3_kl"]
    assert first_r3["mismatch/abs_log_ratio"] < first["mismatch/abs_log_ratio"]
    assert first["mismatch/token_mult_prob_error"] > 1.0 and 0.0 < first["mismatch/is_ess_frac"] <= 1.0


def test_fp8_sim_rounds_routers_and_experts_per_tensor_as_it_loads():
    """The engine is given the trainer's exact weights; fp8_sim keeps, per router and per expert matrix, values on
    the float8_e4m3fn grid of that tensor's scale (amax / 448), within e4m3's relative step of the original; the rest
    of the model is the bf16 cast."""
    from megagspo.data import load_tokenizer
    from megagspo.rollout.hf_engine import FP8_MAX, HFRolloutEngine, fp8_round
    from moe.architecture import Qwen3MoeArchitecture
    from moe.hf_checkpoint import megatron_state_dict_from_hf

    w = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)) * 0.02
    r = fp8_round(w)
    scale = w.abs().max() / FP8_MAX
    assert torch.equal((r / scale).to(torch.float8_e4m3fn).float() * scale, r)  # on the grid
    assert float(((r - w).abs() / w.abs().clamp_min(scale * 2 ** -6)).max()) <= 2 ** -3  # e4m3: 3 mantissa bits
    assert torch.equal(fp8_round(torch.zeros(3)), torch.zeros(3))

    tok = load_tokenizer("builtin")
    arch = Qwen3MoeArchitecture(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=64)
    fp8 = HFRolloutEngine(arch, tok, record_routes=False, precision="fp8_sim")
    bf16 = HFRolloutEngine(arch, tok, record_routes=False, precision="bf16")
    assert fp8.dtype == bf16.dtype == torch.bfloat16
    # the trainer's exact (fp32) weights, not on any bf16 grid: what the weight sync carries
    hf_state = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) * 0.02
                for i, (k, v) in enumerate(fp8.model.state_dict().items())}
    state = megatron_state_dict_from_hf(hf_state, arch)
    for engine in (fp8, bf16):
        engine.update_weights(state)
    p8, p16 = dict(fp8.model.named_parameters()), dict(bf16.model.named_parameters())
    gate = "model.layers.0.mlp.gate.weight"
    assert torch.equal(p8[gate], fp8_round(p16[gate])) and not torch.equal(p8[gate], p16[gate])
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    for e in range(arch.num_experts):
        assert torch.equal(p8[experts][e], fp8_round(p16[experts][e]))
    assert torch.equal(p8["model.embed_tokens.weight"], p16["model.embed_tokens.weight"])


def test_no_sampled_token_gets_a_filler_route():
    """The embedded engine reports routes for every position it fed, the last sampled token's input included: a
    sequence's model-input positions (prompt + response up to its last token, minus the final target) all carry
    real routes, never the -1 the step would replace with a filler."""
    from megagspo.data import load_tokenizer
    from megagspo.rl.batch import sequence_lengths
    from megagspo.rollout import SamplingParams
    from megagspo.rollout.hf_engine import HFRolloutEngine
    from moe.architecture import Qwen3MoeArchitecture

    torch.manual_seed(0)
    tok = load_tokenizer("builtin")
    arch = Qwen3MoeArchitecture(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=64)
    engine = HFRolloutEngine(arch, tok, record_routes=True)
    prompts = [tok.encode("12+34="), tok.encode("7+8=")]
    out = engine.generate(prompts, 3, SamplingParams(6, generator=torch.Generator().manual_seed(1)))
    lengths = sequence_lengths(out.prompt_ids, out.response_mask_RL)
    for r, n in enumerate(lengths):
        assert bool((out.routes_RPLyK[r, :n] >= 0).all()), f"row {r}: a filler where the engine fed a token"


def test_the_dial_is_checked_and_reaches_sglang_as_launch_arguments():
    from megagspo.config import ConfigError, RolloutConfig
    from megagspo.rollout.sglang.config import SGLangEngineConfig, with_engine_dtype
    from megagspo.rollout.sglang.errors import SGLangConfigError

    with pytest.raises(ConfigError, match="rollout.engine_dtype"):
        RolloutConfig(engine_dtype="fp4")
    launched = SGLangEngineConfig(launch={"model_path": "/m", "extra_args": ["--mem-fraction-static", "0.8"]},
                                  sync_dir="/shared/sync")
    fp8 = with_engine_dtype(launched, "fp8_sim")
    assert fp8.launch.extra_args == ("--mem-fraction-static", "0.8", "--dtype", "bfloat16", "--quantization", "fp8")
    assert with_engine_dtype(launched, "auto") is launched
    with pytest.raises(SGLangConfigError, match="servers attached by sglang.urls run the dtype they were started"):
        with_engine_dtype(SGLangEngineConfig(urls=["http://h:1"], sync_dir="/shared/sync"), "bf16")
    with pytest.raises(SGLangConfigError, match="both set the servers' precision"):
        with_engine_dtype(SGLangEngineConfig(launch={"model_path": "/m", "extra_args": ["--dtype=float16"]},
                                             sync_dir="/shared/sync"), "bf16")


def _aux_coef_body(rank, world_size):
    from megatron.core.transformer.moe.router import TopKRouter

    from moe.architecture import Qwen3MoeArchitecture
    from moe.cpu_shim import apply_cpu_shim
    from moe.model import build_model, set_router_aux_loss_coef
    from moe.parallel import ParallelLayout, initialize_model_parallel

    apply_cpu_shim()
    initialize_model_parallel(ParallelLayout())
    arch = Qwen3MoeArchitecture(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=32, router_aux_loss_coef=0.0)
    model = build_model(arch)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    before = [m.is_aux_loss_enabled() for m in routers]
    was = set_router_aux_loss_coef(model, 0.5)
    return {"was": was, "before": before, "after": [(m.get_aux_loss_coeff("aux_loss"), m.is_aux_loss_enabled())
                                                     for m in routers]}


def test_rl_has_its_own_router_aux_loss_coefficient():
    """rl.router_aux_loss_coef sets the routers' coefficient for the RL phase (the cold start keeps the model's);
    a model built without the aux loss gets it switched on."""
    from megagspo.config import ConfigError, load_config
    from multiprocess import run_distributed

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), ["rl.router_aux_loss_coef=0.01"])
    assert cfg.rl.router_aux_loss_coef == 0.01 and cfg.model.router_aux_loss_coef != 0.01
    assert load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), []).rl.router_aux_loss_coef is None
    with pytest.raises(ConfigError, match="rl.router_aux_loss_coef"):
        load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), ["rl.router_aux_loss_coef=-1"])
    res = run_distributed(_aux_coef_body, world_size=1, timeout_s=120)[0]
    assert res["was"] == 0.0 and res["before"] == [False]
    assert res["after"] == [(0.5, True)]
