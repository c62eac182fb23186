"""The embedded HF engine's rollout log-probs, taken step by step (issue 29, items 1 and 6).

The engine once asked `generate` for every step's logits (`output_logits`), stacked them into [R, T, V] and took
a fp32 log-softmax over the whole tensor: memory R x T x V (3 copies), 22 GiB for 8 x 1,536 tokens at Qwen3's
V = 151,936. It now turns each step's logits into the sampled token's log-prob as soon as the token is drawn
(megagspo/rollout/hf_engine.py, `_StepLogProbs`). The former path is kept here as `_stacked_reference`, and:

* on a small vocabulary (prompts of several lengths, stop tokens hit part-way, sampled with temperature and
  top-p, and greedy) the engine's tokens, masks, routes and log-probs equal the reference's bit for bit under
  the same seed (same logits, same per-row fp32 reduction);
* at the real vocabulary, V = 151,936, with a random Qwen3-MoE written by `save_pretrained` and an offline
  300-token BPE tokenizer (the model's vocabulary exceeds the tokenizer's, as Qwen3's does;
  megagspo.tools.tiny_hf_model), the same equality on a few responses;
* `megagspo train` (2 GSPO steps, pi_old = the engine's log-probs) and `megagspo export` from that folder: the
  engine's log-probs agree with Megatron's at V = 151,936 (KL and ratio of a policy with the engine's weights)
  and the export reloads and generates;
* the extra resident memory during `generate` at V = 151,936 (Linux VmHWM, reset before) stays below a few [R, V] fp32 steps, while the reference holds at least T of them;
* the engine's parameters are the policy's dtype on a GPU (bf16 policy -> bf16 engine) and fp32 on the CPU.

Benchmark (not a test): benchmarks/bench_rollout_engine.py; numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch

from megagspo.rollout import HFRolloutEngine, RolloutOutput, SamplingParams
from megagspo.rollout.hf_engine import engine_dtype

from helpers import tiny_arch

QWEN3_VOCAB = 151_936


class _Tok:
    pad_id, eos_id, bos_id = 0, 1, 2
    eos_ids = (1, 3)


def _arch(vocab: int):
    return tiny_arch("moe", vocab_size=vocab, max_position_embeddings=128, intermediate_size=24)


@pytest.fixture
def on_cpu(monkeypatch):
    """The engine on the CPU also on a GPU host: the bit-exact comparisons are CPU claims. One thread: the
    tiny model's ops are too small to split, and on a shared 2-core box two threads per process wait on each
    other (10x slower measured under load)."""
    monkeypatch.setenv("MEGAGSPO_DEVICE", "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def _stacked_reference(engine, prompts, n: int, sampling: SamplingParams) -> RolloutOutput:
    """The engine's former `generate`, verbatim in what it computed: every step's raw logits from `generate`
    (`output_logits`), stacked to [R, T, V] in fp32, log-softmax over V, the sampled token gathered."""
    from transformers import GenerationConfig

    tok = engine.tokenizer
    num = len(prompts) * n
    max_new = sampling.max_new_tokens
    max_prompt = max(len(p) for p in prompts)
    response_RL = torch.full((num, max_new), tok.pad_id, dtype=torch.long)
    mask_RL = torch.zeros((num, max_new), dtype=torch.bool)
    logp_RL = torch.zeros((num, max_new), dtype=torch.float32)
    n_layers = len(engine._gates)
    routes = None
    if engine.record_routes and n_layers:
        routes = torch.full((num, max_prompt + max_new - 1, n_layers, engine.arch.num_experts_per_tok), -1,
                            dtype=torch.int16)
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new, do_sample=not sampling.greedy,
        temperature=sampling.temperature if not sampling.greedy else None,
        top_p=sampling.top_p if not sampling.greedy else None, top_k=None,
        pad_token_id=tok.pad_id, eos_token_id=list(tok.eos_ids), bos_token_id=tok.bos_id,
        output_logits=True, return_dict_in_generate=True,
    )
    by_len = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    for plen, idx in by_len.items():
        rows = torch.tensor([r for i in idx for r in range(i * n, i * n + n)])
        input_ids = torch.tensor([list(prompts[i]) for i in idx for _ in range(n)], dtype=torch.long,
                                 device=engine.device)
        engine._routes.clear()
        engine._recording = routes is not None
        try:
            out = engine.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                        generation_config=gen_cfg)
        finally:
            engine._recording = False
        new_RT = out.sequences[:, plen:]
        steps = new_RT.shape[1]
        logits_RTV = torch.stack(out.logits, dim=1).float()
        lp_RT = torch.log_softmax(logits_RTV, dim=-1).gather(-1, new_RT[..., None]).squeeze(-1).cpu()
        del logits_RTV
        new_RT = new_RT.cpu()
        is_eos = torch.isin(new_RT, torch.tensor(tok.eos_ids, dtype=new_RT.dtype))
        before_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0
        response_RL[rows, :steps] = torch.where(before_eos, new_RT, torch.full_like(new_RT, tok.pad_id))
        mask_RL[rows, :steps] = before_eos
        logp_RL[rows, :steps] = torch.where(before_eos, lp_RT, torch.zeros_like(lp_RT))
        if routes is not None:
            for layer in range(n_layers):
                chunks = [c.reshape(len(rows), -1, c.shape[-1]) for c in engine._routes[layer]]
                r_RPK = torch.cat(chunks, dim=1)
                width = min(r_RPK.shape[1], plen + steps - 1)
                routes[rows, :width, layer] = r_RPK[:, :width].to("cpu", torch.int16)
    prompt_ids = [list(p) for p in prompts for _ in range(n)]
    return RolloutOutput(prompt_ids, response_RL, mask_RL, logp_RL, routes)


def _both(engine, prompts, n, sampling, seed):
    torch.manual_seed(seed)
    new = engine.generate(prompts, n, sampling)
    torch.manual_seed(seed)
    old = _stacked_reference(engine, prompts, n, sampling)
    return new, old


def _assert_equal_rollouts(new: RolloutOutput, old: RolloutOutput) -> None:
    assert new.prompt_ids == old.prompt_ids
    assert torch.equal(new.response_ids_RL, old.response_ids_RL)
    assert torch.equal(new.response_mask_RL, old.response_mask_RL)
    assert new.logp_RL.dtype == old.logp_RL.dtype == torch.float32
    assert torch.equal(new.logp_RL, old.logp_RL), (new.logp_RL - old.logp_RL).abs().max()
    assert (new.routes_RPLyK is None) == (old.routes_RPLyK is None)
    if new.routes_RPLyK is not None:
        assert torch.equal(new.routes_RPLyK, old.routes_RPLyK)


SAMPLINGS = {
    "temperature-top_p": SamplingParams(max_new_tokens=14, temperature=0.7, top_p=0.9),
    "plain": SamplingParams(max_new_tokens=14),
    "greedy": SamplingParams(max_new_tokens=14, greedy=True),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_step_logprobs_equal_the_stacked_reference(on_cpu, name):
    torch.manual_seed(0)
    engine = HFRolloutEngine(_arch(40), _Tok())
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    stopped = 0
    for seed in range(2):
        new, old = _both(engine, prompts, 3, SAMPLINGS[name], seed)
        _assert_equal_rollouts(new, old)
        assert new.response_mask_RL[:, 0].all()
        stopped += int((new.response_mask_RL.sum(1) < SAMPLINGS[name].max_new_tokens).sum())
        assert (new.logp_RL[new.response_mask_RL] < 0).all()
    if name != "greedy":
        assert stopped > 0  # stop tokens were drawn part-way: masks and later steps' pads are exercised


def test_generate_no_longer_asks_for_every_steps_logits(on_cpu, monkeypatch):
    """The memory claim in its mechanism: `generate` is asked for neither `output_logits` nor `output_scores`."""
    engine = HFRolloutEngine(_arch(40), _Tok(), record_routes=False)
    seen = {}
    real = engine.model.generate

    def spy(*args, **kwargs):
        seen.update(kwargs["generation_config"].to_dict())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "generate", spy)
    engine.generate([[5, 6]], 2, SamplingParams(max_new_tokens=4))
    assert not seen.get("output_logits") and not seen.get("output_scores")


@pytest.fixture(scope="module")
def qwen_vocab_kit(tmp_path_factory):
    """A random Qwen3-MoE at V = 151,936 with an offline 300-token BPE tokenizer, in an HF folder."""
    from megagspo.tools.tiny_hf_model import TinyHFSpec, build_tiny_hf_model

    spec = TinyHFSpec(hidden_size=32, head_dim=8, moe_intermediate_size=16, vocab_multiple=QWEN3_VOCAB,
                      train_rows=16, eval_rows=4)
    kit = build_tiny_hf_model(str(tmp_path_factory.mktemp("qwen_vocab") / "model"), spec)
    assert kit["vocab_size"] == QWEN3_VOCAB
    return kit


def _engine_from_folder(folder: str, record_routes: bool = True):
    from transformers import AutoModelForCausalLM

    from megagspo.data import load_tokenizer
    from moe.hf_config import architecture_from_hf_config

    arch = architecture_from_hf_config(folder)
    tokenizer = load_tokenizer(folder)
    engine = HFRolloutEngine(arch, tokenizer, record_routes=record_routes)
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine.model.load_state_dict(source.state_dict())
    return engine, tokenizer


def test_real_vocabulary_logprobs_equal_the_stacked_reference(on_cpu, qwen_vocab_kit):
    engine, tokenizer = _engine_from_folder(qwen_vocab_kit["model"])
    with open(os.path.join(qwen_vocab_kit["model"], "config.json")) as f:
        assert json.load(f)["vocab_size"] == QWEN3_VOCAB
    assert tokenizer.vocab_size < QWEN3_VOCAB  # the model's vocabulary exceeds the tokenizer's, as Qwen3's does
    prompts = [tokenizer.encode("Tom has 3 apples and buys 4 more."), tokenizer.encode("A box holds 9 pens.")]
    new, old = _both(engine, prompts, 2, SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95), seed=5)
    _assert_equal_rollouts(new, old)
    assert int(new.response_mask_RL.sum()) >= 4
    # a random model at this vocabulary: log-probs around -log V, far from the 320-token kit's
    assert float(new.logp_RL[new.response_mask_RL].mean()) < -10.0


@pytest.mark.slow
def test_gspo_steps_and_export_at_the_real_vocabulary(qwen_vocab_kit, tmp_path):
    """`megagspo train` from the V = 151,936 folder, 2 GSPO steps with pi_old = the engine's log-probs
    (rl.old_logp=rollout) and one mini-batch per step, so that each step's policy has exactly the weights the
    engine generated with: its KL to pi_old and its ratio check the engine's streamed log-probs against
    Megatron's at that vocabulary (measured: KL 1.7e-13, ratio 1.0). Then `megagspo export`, which reloads in
    transformers at that vocabulary and generates. About 30 s of CPU."""
    from helpers import CliRuns
    from multiprocess import cpu_pinned_env

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = cpu_pinned_env()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    kit = qwen_vocab_kit
    runs = CliRuns(env, str(tmp_path / "cli.log"))  # train and export (both only read afterwards): one start-up

    def cli(*args):
        proc = runs.run(list(args), timeout=600)
        assert proc.returncode == 0, f"{args}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"

    try:
        _train_and_export_at_the_real_vocabulary(cli, kit, tmp_path)
    finally:
        runs.close()


def _train_and_export_at_the_real_vocabulary(cli, kit, tmp_path):
    cli("train", "--config", "configs/tiny_hf_cpu.yaml", f"model.init_from={kit['model']}",
        f"data.train_path={kit['train']}", f"data.eval_path={kit['eval']}", f"log.out_dir={tmp_path}",
        "threads=1", "log.progress=false", "log.plots=false", "log.tensorboard=false", "rl.steps=2",
        "rl.eval_every=2", "rl.old_logp=rollout", "rl.mini_batches=1", "name=v152k")
    rows = [json.loads(line) for line in open(tmp_path / "v152k" / "metrics.jsonl")]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["reward/errors"] == 0 for r in rl)
    # sampling over the whole 151,936-token vocabulary of a random model: entropy near log V = 11.93
    assert all(r["entropy/mean"] > 11.0 for r in rl)
    # fp32 weights just synced, one mini-batch: pi_theta = the engine's policy, so pi_theta / pi_old = 1 up to
    # the two implementations' fp32 rounding (a shifted token or a wrong vocabulary would give nats)
    for r in rl:
        assert r["kl/approx_old"] < 1e-9 and abs(r["ratio/mean"] - 1.0) < 1e-5, r
    cli("export", "--checkpoint", str(tmp_path / "v152k"), "--out", str(tmp_path / "exported"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    assert model.config.vocab_size == QWEN3_VOCAB
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_extra_rss_bytes(fn) -> int:
    """The peak resident memory of this process during fn() above its resident memory just before (Linux:
    the high-water mark VmHWM, reset to the current RSS by writing 5 to /proc/self/clear_refs). Large blocks
    (the [R, T, V] logits) are mmapped by the allocator and unmapped when freed, so they show here in full."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - before) * 1024


def test_extra_memory_is_one_step_of_logits_at_the_real_vocabulary(on_cpu):
    torch.manual_seed(0)
    engine = HFRolloutEngine(_arch(QWEN3_VOCAB), _Tok(), record_routes=False)
    R, T = 4, 24
    step_bytes = R * QWEN3_VOCAB * 4  # one step's [R, V] fp32 logits
    sampling = SamplingParams(max_new_tokens=T)
    engine.generate([[5, 6, 7]], R, sampling)  # warm: thread pools, first-touch of the weights
    new_peak = peak_extra_rss_bytes(lambda: engine.generate([[5, 6, 7]], R, sampling))
    old_peak = peak_extra_rss_bytes(lambda: _stacked_reference(engine, [[5, 6, 7]], R, sampling))
    print(f"extra CPU bytes at V={QWEN3_VOCAB}, {R} x {T}: step-wise {new_peak / 2**20:.1f} MiB, "
          f"stacked {old_peak / 2**20:.1f} MiB (one step {step_bytes / 2**20:.1f} MiB)")
    assert new_peak < 6 * step_bytes  # a few [R, V] fp32 transients of one step, whatever T is
    assert old_peak > 2 * T * step_bytes  # the stacked logits and their log-softmax: [R, T, V] twice at least


def test_engine_dtype_follows_a_bf16_policy_on_a_gpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert engine_dtype(None, cuda) == torch.float32
    assert engine_dtype("bf16", cuda) == engine_dtype(torch.bfloat16, cuda) == torch.bfloat16
    assert engine_dtype("fp32", cuda) == torch.float32
    assert engine_dtype("bf16", cpu) == engine_dtype(torch.bfloat16, cpu) == torch.float32
    with pytest.raises(ValueError, match="fp16.*valid values: fp32, bf16"):
        engine_dtype("fp16", cuda)


def test_cpu_engine_stays_float32_for_a_bf16_policy(on_cpu):
    engine = HFRolloutEngine(_arch(40), _Tok(), dtype="bf16")
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


@pytest.mark.gpu
def test_bf16_engine_on_a_gpu_matches_the_reference(monkeypatch):
    """On CUDA a bf16 policy's engine holds bf16 weights; its step-wise log-probs equal the stacked reference
    on the same model up to the fp32 log-softmax's reduction order (the two paths reduce [R, V] and [R, T, V])."""
    monkeypatch.setenv("MEGAGSPO_DEVICE", "cuda")
    torch.manual_seed(0)
    engine = HFRolloutEngine(_arch(QWEN3_VOCAB), _Tok(), dtype="bf16")
    assert engine.device.type == "cuda"
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    new, old = _both(engine, [[5, 6, 7], [8, 9]], 4, SamplingParams(max_new_tokens=32), seed=3)
    assert torch.equal(new.response_ids_RL, old.response_ids_RL)
    assert torch.equal(new.response_mask_RL, old.response_mask_RL)
    torch.testing.assert_close(new.logp_RL, old.logp_RL, atol=1e-5, rtol=1e-6)
    peak = {}
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine.generate([[5, 6, 7]], 8, SamplingParams(max_new_tokens=512))
    peak["new"] = torch.cuda.max_memory_allocated() - base
    assert peak["new"] < 2**30, peak
