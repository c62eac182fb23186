"""The path a user takes from a Hugging Face model to RL, with nothing downloaded: a tiny random Qwen3-MoE
written by `save_pretrained`, a BPE tokenizer trained offline with a chat template and a generation config,
and a GSM8K-style math JSONL (`megagspo.tools.tiny_hf_model`).

- `model.init_from` = that folder: the architecture comes from its config.json, the tokenizer from the folder,
  prompts go through the chat template, and the first forward's log-probs equal transformers' on the same ids;
- `megagspo train` runs GSPO steps with the math-verify reward; `megagspo export` of the result loads in
  transformers (model and tokenizer) and generates; a sharded folder starts a 2-process EP=2 run;
- a folder that does not fit fails before any compute, naming the tensor (dry run and trainer alike);
- a model exported by `megagspo export` starts RL again from exactly its weights.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO, CliRuns
from multiprocess import cpu_pinned_env

FAST = ["threads=1", "log.progress=false", "log.plots=false", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    from megagspo.tools.tiny_hf_model import build_tiny_hf_model

    return build_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_hf") / "model"))


def _recipe(kit, out_dir, *extra):
    return ["--config", "configs/tiny_hf_cpu.yaml", f"model.init_from={kit['model']}",
            f"data.train_path={kit['train']}", f"data.eval_path={kit['eval']}", f"log.out_dir={out_dir}",
            *FAST, *extra]


def _env():
    env = cpu_pinned_env()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's `megagspo` commands, all only read afterwards: a command costs its work, not
    a fresh start-up. The torchrun run has processes of its own."""
    cli_runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield cli_runs
    cli_runs.close()


def _cli(cli, *args, timeout=300, ok=True):
    proc = cli.run(list(args), timeout=timeout)
    if ok:
        assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_hf_tokenizer_renders_chat_prompts_and_reads_stop_tokens(kit):
    from megagspo.data import load_tokenizer

    tok = load_tokenizer(kit["model"])
    assert tok.prompt_format == "chat"
    im_start, im_end, endoftext = (tok.tok.convert_tokens_to_ids(t) for t in
                                   ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tok.eos_ids == (im_end, endoftext) and tok.eos_id == im_end and tok.pad_id == endoftext
    ids = tok.prompt_ids("What is 2 + 3?")
    assert ids == tok.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == im_start and tok.prompt_ids([{"role": "user", "content": "What is 2 + 3?"}]) == ids
    # plain format: the text as is; a message list is refused with the switch to use
    plain = load_tokenizer(kit["model"], "plain")
    assert plain.prompt_ids("What is 2 + 3?") == tok.encode("What is 2 + 3?")
    with pytest.raises(ValueError, match="data.prompt_format = 'chat'"):
        plain.prompt_ids([{"role": "user", "content": "hi"}])
    # decoding stops at either stop token
    body = tok.encode("#### 5")
    assert tok.decode(body + [endoftext] + tok.encode("junk")) == "#### 5"
    assert tok.decode(body + [im_end] + tok.encode("junk")) == "#### 5"


def test_chat_template_kwargs_reach_the_template(kit):
    """data.chat_template_kwargs: Qwen3's enable_thinking=false pre-fills an empty thinking block."""
    from megagspo.data import load_tokenizer

    thinking, plain_turn = load_tokenizer(kit["model"]), load_tokenizer(kit["model"], "auto", {"enable_thinking": False})
    base = thinking.prompt_ids("What is 2 + 3?")
    assert plain_turn.prompt_ids("What is 2 + 3?") == base + thinking.encode("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="built-in tokenizer has no chat template"):
        load_tokenizer("builtin", "auto", {"enable_thinking": False})


def test_broken_tokenizer_folders_get_clear_errors(kit, tmp_path):
    from megagspo.data import load_tokenizer

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty' holds no tokenizer: expected tokenizer.json"):
        load_tokenizer(str(empty))
    no_template = tmp_path / "no_template"
    shutil.copytree(kit["model"], no_template)
    (no_template / "chat_template.jinja").unlink()
    assert load_tokenizer(str(no_template)).prompt_format == "plain"  # auto falls back to plain text
    with pytest.raises(ValueError, match="data.prompt_format = 'chat' but tokenizer .* has no chat template"):
        load_tokenizer(str(no_template), "chat")
    bad_gen = tmp_path / "bad_gen"
    shutil.copytree(kit["model"], bad_gen)
    (bad_gen / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10**6]}))
    with pytest.raises(ValueError, match="lies outside the tokenizer"):
        load_tokenizer(str(bad_gen))


def test_first_forward_logprobs_equal_transformers(kit, tmp_path):
    """The trainer's model after init_from gives, on the chat-rendered prompt of a training row plus a
    response, the log-probs transformers gives from the same folder (float32)."""
    from transformers import AutoModelForCausalLM

    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny_hf_cpu.yaml"),
                      _recipe(kit, tmp_path)[2:] + ["log.save_checkpoint=false"])
    assert cfg.data.tokenizer == kit["model"]  # data.tokenizer: auto took the folder's tokenizer
    trainer = Trainer(cfg, quiet=True)
    assert trainer.arch.vocab_size == kit["vocab_size"] > trainer.tokenizer.vocab_size  # padded vocabulary
    example = trainer.train_ds.examples[0]
    tok = trainer.tokenizer
    assert list(example.prompt_ids) == tok.prompt_ids(example.prompt)
    ids = list(example.prompt_ids) + tok.encode(example.answer) + [tok.eos_id]
    input_BS, target_BS = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    with torch.no_grad():
        logp_BS, _ = trainer.policy.token_logprobs(input_BS.to(trainer.policy.device),
                                                   target_BS.to(trainer.policy.device))
        hf = AutoModelForCausalLM.from_pretrained(kit["model"], dtype=torch.float32).eval()
        ref_BS = torch.log_softmax(hf(input_BS).logits.float(), -1).gather(-1, target_BS[..., None])[..., 0]
    delta = float((logp_BS.cpu().float() - ref_BS).abs().max())
    print(f"max |logp - transformers logp| = {delta:.2e} over {target_BS.numel()} tokens")
    assert delta < 2e-5, delta
    # the same reference the trainer would have built from a random init differs grossly: the load is real
    assert float(ref_BS.abs().mean()) > 1.0


@pytest.mark.slow
def test_gspo_from_hf_folder_then_export_loads_in_transformers(cli, kit, tmp_path):
    _cli(cli, "train", *_recipe(kit, tmp_path, "rl.steps=2", "rl.eval_every=2", "name=hf_run"))
    run = tmp_path / "hf_run"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 2 and all(0.0 <= r["reward/mean"] <= 1.0 and r["reward/errors"] == 0 for r in rl)
    _cli(cli, "export", "--checkpoint", str(run), "--out", str(tmp_path / "exported"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "exported")
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        tokenize=False)
    ids = hf_tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    # the exported weights are the trained ones: they moved away from the starting folder's
    start = AutoModelForCausalLM.from_pretrained(kit["model"], dtype=torch.float32)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), start.state_dict().values()))
    assert moved > 0.0


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _non_weight_files(folder) -> dict:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name)) and not name.startswith("model-")
            and name not in WEIGHT_FILES}


@pytest.mark.slow
def test_export_of_an_hf_initialised_run_is_its_source_but_the_weights(cli, kit, tmp_path):
    """model.init_from = an HF folder, GSPO steps, `megagspo export`: every file but the weights is the source's,
    byte for byte (tokenizer files, generation_config.json with its sampling defaults and stop tokens,
    config.json with its bos/eos/pad ids); no megagspo-private file; the weights are the trained ones. The one
    config.json field training can change, the weights' dtype, stays here (float32 folder, float32 run)."""
    source = tmp_path / "source"
    shutil.copytree(kit["model"], source)
    for name in ("math_train.jsonl", "math_eval.jsonl"):  # the kit's data, not part of a model folder
        os.remove(source / name)
    # Qwen's folder has sampling defaults and no bos; a re-serialising loader would drop or rewrite them
    gen = json.loads((source / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    (source / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    source_config = json.loads((source / "config.json").read_text())
    assert source_config.get("bos_token_id") is None
    run_args = ["--config", "configs/tiny_hf_cpu.yaml", f"model.init_from={source}", f"data.train_path={kit['train']}",
                f"data.eval_path={kit['eval']}", f"log.out_dir={tmp_path}", *FAST, "rl.steps=1", "rl.eval_every=1",
                "name=run"]
    _cli(cli, "train", *run_args)
    proc = _cli(cli, "export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "exported"))
    assert "config.json:" in proc.stdout and "unchanged" in proc.stdout, proc.stdout
    exported, original = _non_weight_files(tmp_path / "exported"), _non_weight_files(source)
    assert sorted(exported) == sorted(original), (sorted(exported), sorted(original))
    for name, data in original.items():
        assert exported[name] == data, name
    assert not os.path.exists(tmp_path / "exported" / "megagspo_vocab.pt")
    from megagspo.data import load_tokenizer

    tok = load_tokenizer(str(tmp_path / "exported"))
    assert tok.bos_id is None and tok.bos_id == load_tokenizer(str(source)).bos_id
    from safetensors.torch import load_file

    new, old = load_file(tmp_path / "exported" / "model.safetensors"), load_file(source / "model.safetensors")
    assert new.keys() == old.keys() and all(new[k].dtype == old[k].dtype for k in new)
    assert any(not torch.equal(new[k], old[k]) for k in new)  # trained


def test_export_dtype_and_config_rewrite():
    """The weights' dtype is the one config.json field an export may change: written in the source's dtype
    where that holds the trained values exactly, else float32, with only that value's bytes replaced."""
    from megagspo.hf_export import config_with_dtype, export_dtype

    assert export_dtype("float32", "bf16") == "float32" and export_dtype("bfloat16", "bf16") == "bfloat16"
    assert export_dtype("bfloat16", "fp32") == "float32" and export_dtype("float16", "bf16") == "float32"
    text = '{\n  "architectures": ["Qwen3MoeForCausalLM"],\n  "bos_token_id": null,\n  "dtype": "bfloat16",\n' \
           '  "eos_token_id": 151645\n}\n'
    assert config_with_dtype(text, "dtype", "bfloat16", "float32") == text.replace('"bfloat16"', '"float32"')
    assert config_with_dtype(text, "dtype", "bfloat16", "bfloat16") == text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sharded_hf_folder_starts_an_expert_parallel_run(tmp_path):
    """A sharded folder (model.safetensors.index.json) under torchrun, EP=2: each rank reads its experts."""
    from megagspo.tools.tiny_hf_model import TinyHFSpec, build_tiny_hf_model

    kit = build_tiny_hf_model(str(tmp_path / "sharded"), TinyHFSpec(max_shard_bytes=120_000, seed=3))
    assert os.path.isfile(os.path.join(kit["model"], "model.safetensors.index.json"))
    env = _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megagspo.cli", "train", *_recipe(kit, tmp_path, "rl.steps=1", "rl.eval_every=1",
                                                   "parallel.expert_parallel=2", "name=ep2")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "ep2" / "metrics.jsonl")]
    assert sum(r["phase"] == "rl" for r in rows) == 1


def _corrupt_one_tensor(src: str, dst) -> str:
    """A copy of the folder whose first expert's down projection has one row too few."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    key = next(k for k in sorted(tensors) if "experts.0.down_proj" in k)
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return key


def test_folder_that_does_not_fit_fails_before_compute(cli, kit, tmp_path):
    bad = tmp_path / "bad"
    key = _corrupt_one_tensor(kit["model"], bad)
    args = ["--config", "configs/tiny_hf_cpu.yaml", f"model.init_from={bad}", f"data.train_path={kit['train']}",
            f"data.eval_path={kit['eval']}", f"log.out_dir={tmp_path / 'runs'}", *FAST]
    for command in (["train", "--dry-run"], ["train"]):
        proc = _cli(cli, *command, *args, ok=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert key in proc.stderr and "does not fit this model" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing was written: the check came before any compute
    # a header that is not safetensors, and a config.json that is not JSON: the same one-line refusal
    garbled = tmp_path / "garbled"
    shutil.copytree(kit["model"], garbled)
    (garbled / "model.safetensors").write_bytes(b"\xff" * 64)
    proc = _cli(cli, "train", "--dry-run", *args[:2], f"model.init_from={garbled}", *args[3:], ok=False)
    assert proc.returncode == 2 and "not a readable safetensors file" in proc.stderr, proc.stderr[-2000:]
    (garbled / "config.json").write_text("{not json")
    proc = _cli(cli, "train", "--dry-run", *args[:2], f"model.init_from={garbled}", *args[3:], ok=False)
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # a recipe that describes another model than the folder is refused, naming the field
    proc = _cli(cli, "train", "--dry-run", *_recipe(kit, tmp_path, "model.hidden_size=128"), ok=False)
    assert "model.hidden_size = 128 but config.json has 64" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_megagspo_export_starts_rl_from_exactly_its_weights(cli, tmp_path):
    """tiny_cpu (built-in tokenizer) -> `megagspo export` -> `model.init_from`: the new run starts from the
    exported weights bit for bit (its step-0 checkpoint equals the first run's final one) and at the held-out
    accuracy the first run ended with."""
    from megagspo.checkpoint.full_state import load_checkpoint

    short = ["data.train_size=200", "data.eval_size=20", "rl.prompts_per_step=4", "rl.group_size=4",
             "rl.mini_batches=2", "rl.eval_every=1", "rl.eval_samples=0", *FAST]
    _cli(cli, "train", "--config", "configs/tiny_cpu.yaml", *short, "sft.steps=30", "sft.batch_size=32", "rl.steps=1",
         "name=first", f"log.out_dir={tmp_path}")
    _cli(cli, "export", "--checkpoint", str(tmp_path / "first"), "--out", str(tmp_path / "first_hf"))
    _cli(cli, "train", "--config", "configs/tiny_cpu.yaml", *short, "sft.steps=0", "rl.steps=0", "name=second",
         f"model.init_from={tmp_path / 'first_hf'}", f"log.out_dir={tmp_path}")
    first, second = load_checkpoint(str(tmp_path / "first")), load_checkpoint(str(tmp_path / "second"))
    assert first["state"].keys() == second["state"].keys()
    for name, tensor in first["state"].items():
        assert torch.equal(tensor, second["state"][name]), name
    assert json.load(open(tmp_path / "second" / "summary.json"))["init/accuracy"] == \
        json.load(open(tmp_path / "first" / "summary.json"))["final/accuracy"]
    # a summary names only the stages that ran: no cold start with sft.steps = 0
    assert "cold_start/accuracy" in json.load(open(tmp_path / "first" / "summary.json"))
    assert not any(k.startswith("cold_start/") for k in json.load(open(tmp_path / "second" / "summary.json")))


def test_init_from_casts_to_the_runs_precision(kit, tmp_path):
    """model.precision=bf16: each weight is the folder's float32 tensor rounded to bf16 (embedding, one expert)."""
    from safetensors.torch import load_file

    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny_hf_cpu.yaml"),
                      _recipe(kit, tmp_path)[2:] + ["model.precision=bf16", "log.save_checkpoint=false"])
    model = Trainer(cfg, quiet=True).policy.model
    hf = load_file(os.path.join(kit["model"], "model.safetensors"))
    embedding = model.embedding.word_embeddings.weight
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding.cpu(), hf["model.embed_tokens.weight"].to(torch.bfloat16))
    params = dict(model.named_parameters())
    down = params["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert down.dtype == torch.bfloat16
    assert torch.equal(down.cpu(), hf["model.layers.1.mlp.experts.2.down_proj.weight"].to(torch.bfloat16))
