"""Build, offline, a tiny Hugging Face starting point for the RL pipeline: a random Qwen3-MoE written by
`save_pretrained`, a byte-level BPE tokenizer trained here with the `tokenizers` library plus a chat
template and a generation config, and small math datasets (JSONL) with verifiable answers.

It exercises the path a real run takes from a Hub download (`model.init_from` = an HF folder, its
tokenizer, chat-formatted prompts, the `math` reward) with nothing downloaded:

    python -m megagspo.tools.tiny_hf_model --out runs/tiny_hf_model
    megagspo train --config configs/tiny_hf_cpu.yaml model.init_from=runs/tiny_hf_model \\
        data.train_path=runs/tiny_hf_model/math_train.jsonl data.eval_path=runs/tiny_hf_model/math_eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The Qwen3 chat layout: each message framed by <|im_start|>role ... <|im_end|>, then the assistant's turn
# opened; enable_thinking=false pre-fills an empty thinking block, as Qwen3's own template does.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
INSTRUCTION = "Put the final answer after ####."


@dataclass(frozen=True)
class TinyHFSpec:
    """Sizes of the tiny model and data; validated on construction."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 32
    num_experts: int = 4
    num_experts_per_tok: int = 2
    tokenizer_vocab: int = 300  # BPE merges stop here (specials and the 256 byte symbols included)
    vocab_multiple: int = 64  # the model's vocabulary is padded up to a multiple of this, as Qwen's is
    train_rows: int = 64
    eval_rows: int = 16
    max_shard_bytes: int = 0  # > 0: a sharded checkpoint with model.safetensors.index.json
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 0 or (value == 0 and name not in ("max_shard_bytes", "seed")):
                raise ValueError(f"TinyHFSpec.{name} must be a positive integer, got {value!r}")
        if self.tokenizer_vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"TinyHFSpec.tokenizer_vocab must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")


def math_rows(count: int, seed: int) -> list[dict]:
    """Arithmetic word problems as chat messages; answers in GSM8K's style (working, then "#### n")."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        if rng.random() < 0.5:
            question, work, value = f"Tom has {a} apples and buys {b} more. How many apples does he have?", \
                f"{a} + {b} = {a + b}", a + b
        else:
            big, small = max(a, b), min(a, b)
            question, work, value = f"A box holds {big} pens. {small} are taken out. How many pens are left?", \
                f"{big} - {small} = {big - small}", big - small
        rows.append({"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "answer": f"{work}\n#### {value}"})
    return rows


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def build_tiny_hf_model(out: str, spec: TinyHFSpec = TinyHFSpec()) -> dict:
    """Write the model folder (weights, config, tokenizer, generation config) and math_{train,eval}.jsonl
    into `out`; returns {"model": out, "train": path, "eval": path, "vocab_size": model vocabulary}."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(out, exist_ok=True)
    train, held_out = math_rows(spec.train_rows, spec.seed), math_rows(spec.eval_rows, spec.seed + 1)
    corpus = [m["content"] + "\n" + r["answer"] for r in train + held_out for m in r["prompt"]]
    tokenizer = _train_tokenizer(corpus, spec.tokenizer_vocab)
    vocab = -(-len(tokenizer) // spec.vocab_multiple) * spec.vocab_multiple
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        moe_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False, norm_topk_prob=True,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config).eval()
    # Stop on either end token, as Qwen3's generation config does.
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")],
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    shard = {"max_shard_size": spec.max_shard_bytes} if spec.max_shard_bytes else {}
    model.save_pretrained(out, **shard)
    tokenizer.save_pretrained(out)
    paths = {"train": os.path.join(out, "math_train.jsonl"), "eval": os.path.join(out, "math_eval.jsonl")}
    for split, rows in (("train", train), ("eval", held_out)):
        with open(paths[split], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return {"model": out, "vocab_size": vocab, **paths}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-bytes", type=int, default=0, help="> 0: write a sharded checkpoint")
    args = parser.parse_args(argv)
    made = build_tiny_hf_model(args.out, TinyHFSpec(seed=args.seed, max_shard_bytes=args.max_shard_bytes))
    print(f"tiny Qwen3-MoE (vocabulary {made['vocab_size']}) with its tokenizer in {made['model']}; "
          f"data {made['train']}, {made['eval']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
