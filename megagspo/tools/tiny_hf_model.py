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
# Qwen3's tool and thinking tags: added (not special) tokens, as in Qwen3's tokenizer, appended after the BPE so
# its merges and ids stay as they were.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# The Qwen3 chat layout: each message framed by <|im_start|>role ... <|im_end|>, then the assistant's turn
# opened; enable_thinking=false pre-fills an empty thinking block. With tools: Qwen3's system block listing
# them; structured tool_calls written as Hermes <tool_call> blocks; consecutive tool results grouped in one
# user turn as <tool_response> blocks. Lines are joined stripped: every newline rendered is a '\n' literal.
_TEMPLATE_LINES = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
@LAST_QUERY@
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        @DROP_THINKING@
        {{- '<|im_start|>assistant\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
                {%- set call = tool_call.function if tool_call.function else tool_call %}
                {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
                {%- if call.arguments is string %}{{- call.arguments }}
                {%- else %}{{- call.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""
# Qwen3's last real user query: the last user message that is not a pure <tool_response> block.
_LAST_QUERY = r"""
{%- set ns = namespace(last_query_index=messages|length - 1, searching=true) %}
{%- for message in messages[::-1] %}
    {%- set wrapped = message.content is string and message.content.startswith('<tool_response>') %}
    {%- set wrapped = wrapped and message.content.endswith('</tool_response>') %}
    {%- if ns.searching and message.role == 'user' and message.content is string and not wrapped %}
        {%- set ns.searching = false %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
"""
# Qwen3 splits an assistant turn at its </think> (or takes message.reasoning_content): a turn before that query
# keeps only its answer; a turn after it is written again as <think>\n{reasoning}\n</think>\n\n{answer}, and the
# last turn so even without reasoning (an empty thinking block Qwen3 writes into a final assistant turn).
_DROP_THINKING = r"""
{%- set reasoning = '' %}
{%- if message.reasoning_content is defined and message.reasoning_content is not none %}
    {%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
    {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
    {%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
    {%- set content = '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') %}
{%- endif %}
"""


def _template(drops_thinking: bool) -> str:
    text = _TEMPLATE_LINES.replace("@LAST_QUERY@", _LAST_QUERY if drops_thinking else "") \
        .replace("@DROP_THINKING@", _DROP_THINKING if drops_thinking else "")
    return "".join(line.strip() for line in text.splitlines())


# Keeps history: assistant turns render as given, so a conversation re-renders as the tokens it was sampled as.
CHAT_TEMPLATE = _template(drops_thinking=False)
# Rewrites history as Qwen3's own template does: an assistant turn before the last real user query loses its
# <think>...</think> part (so the prompt of the turn after that query no longer extends the sampled tokens), and
# the turns after it are re-normalised around their thinking block.
CHAT_TEMPLATE_DROPS_THINKING = _template(drops_thinking=True)
CHAT_TEMPLATES = {"keeps_history": CHAT_TEMPLATE, "drops_thinking": CHAT_TEMPLATE_DROPS_THINKING}
INSTRUCTION = "Put the final answer after ####."


@dataclass(frozen=True)
class TinyHFSpec:
    """Sizes of the tiny model and data, and its chat template (a CHAT_TEMPLATES name); validated on construction."""

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
    chat_template: str = "keeps_history"  # or "drops_thinking": Qwen3's rewriting of history (CHAT_TEMPLATES)

    def __post_init__(self) -> None:
        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"TinyHFSpec.chat_template must be one of {', '.join(CHAT_TEMPLATES)}, "
                             f"got {self.chat_template!r}")
        for name, value in self.__dict__.items():
            if name == "chat_template":
                continue
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


def _train_tokenizer(texts: list[str], vocab_size: int, chat_template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=chat_template)
    tokenizer.add_tokens(list(ADDED_TOKENS))  # ids after the BPE's: its merges and ids are unchanged
    return tokenizer


def _generation_config(tokenizer):
    """Stop on either end token, as Qwen3's generation config does."""
    from transformers import GenerationConfig

    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))


def tiny_tokenizer(spec: TinyHFSpec = TinyHFSpec()):
    """The tiny BPE tokenizer (trained on the spec's math rows) with the spec's chat template and Qwen3's tags."""
    train, held_out = math_rows(spec.train_rows, spec.seed), math_rows(spec.eval_rows, spec.seed + 1)
    corpus = [m["content"] + "\n" + r["answer"] for r in train + held_out for m in r["prompt"]]
    return _train_tokenizer(corpus, spec.tokenizer_vocab, CHAT_TEMPLATES[spec.chat_template])


def build_tiny_hf_tokenizer(out: str, spec: TinyHFSpec = TinyHFSpec()) -> str:
    """Write only the tokenizer and generation config into `out` (no weights: a second, for tokenizer tests)."""
    os.makedirs(out, exist_ok=True)
    tokenizer = tiny_tokenizer(spec)
    tokenizer.save_pretrained(out)
    _generation_config(tokenizer).save_pretrained(out)
    return out


def build_tiny_hf_model(out: str, spec: TinyHFSpec = TinyHFSpec()) -> dict:
    """Write the model folder (weights, config, tokenizer, generation config) and math_{train,eval}.jsonl
    into `out`; returns {"model": out, "train": path, "eval": path, "vocab_size": model vocabulary}."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(out, exist_ok=True)
    train, held_out = math_rows(spec.train_rows, spec.seed), math_rows(spec.eval_rows, spec.seed + 1)
    tokenizer = tiny_tokenizer(spec)
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
    model.generation_config = _generation_config(tokenizer)
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
    parser.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATES), default="keeps_history",
                        help="drops_thinking: Qwen3's template, which drops earlier turns' <think> blocks")
    args = parser.parse_args(argv)
    made = build_tiny_hf_model(args.out, TinyHFSpec(seed=args.seed, max_shard_bytes=args.max_shard_bytes,
                                                    chat_template=args.chat_template))
    print(f"tiny Qwen3-MoE (vocabulary {made['vocab_size']}) with its tokenizer in {made['model']}; "
          f"data {made['train']}, {made['eval']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
