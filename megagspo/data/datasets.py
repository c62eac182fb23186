"""Prompt datasets: (prompt, answer) examples from JSONL / parquet or the synthetic task, tokenised and
checked before any compute.

Every problem is reported at load time with the file, line and field names: a missing file, a row without
the configured `prompt_key` / `answer_key` (the message lists the keys the row has), non-string values,
and prompts longer than `max_prompt_tokens` (counted; an error unless `drop_long_prompts`).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from .tasks import addition_examples
from .tokenizer import load_tokenizer


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and field."""


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    prompt_ids: tuple  # bos + encoded prompt


def _read_rows(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DataError(f"dataset file {path!r} does not exist")
    if path.endswith(".parquet"):
        try:
            import pandas as pd  # noqa: F401
            rows = pd.read_parquet(path).to_dict("records")
        except ImportError:
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"reading {path!r} needs pandas or pyarrow, neither is installed") from None
            rows = pq.read_table(path).to_pylist()
        return rows
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise DataError(f"dataset file {path!r} holds no rows")
    return rows


def load_examples(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[tuple[str, str]]:
    pairs = []
    for i, row in enumerate(_read_rows(path)):
        for key in (prompt_key, answer_key):
            if key not in row:
                raise DataError(
                    f"{path}: row {i} has no field {key!r} (data.{'prompt' if key == prompt_key else 'answer'}_key); "
                    f"the row's fields are {sorted(row)}")
        prompt, answer = row[prompt_key], row[answer_key]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise DataError(f"{path}: row {i}: {prompt_key!r} and {answer_key!r} must be strings, got "
                            f"{type(prompt).__name__} and {type(answer).__name__}")
        pairs.append((prompt, answer))
    return pairs


def encode_examples(pairs, tokenizer, max_prompt_tokens: int, drop_long: bool, where: str,
                    already_long: int = 0) -> tuple[list, int]:
    """-> (examples, number of prompts over the limit). Too-long prompts raise unless drop_long; the error
    counts them together with `already_long` found in the other split(s)."""
    out, too_long = [], []
    for i, (prompt, answer) in enumerate(pairs):
        ids = (tokenizer.bos_id,) + tuple(tokenizer.encode(prompt))
        if len(ids) > max_prompt_tokens:
            too_long.append((i, len(ids)))
            continue
        out.append(Example(prompt, answer, ids))
    if too_long and not drop_long:
        shown = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:5])
        raise DataError(
            f"{where}: {len(too_long) + already_long} of {len(pairs) + already_long} prompts are longer than data.max_prompt_tokens = "
            f"{max_prompt_tokens} (with bos): {shown}{' ...' if len(too_long) > 5 else ''}; raise the limit or "
            "set data.drop_long_prompts=true to drop them")
    if not out:
        raise DataError(f"{where}: no usable prompts")
    return out, len(too_long)


class PromptDataset:
    """Examples with a seeded, epoch-shuffled sampler; `shard(rank, world)` for data parallelism."""

    def __init__(self, examples: list, seed: int = 0) -> None:
        self.examples = list(examples)
        self.rng = random.Random(seed)
        self._order: list = []

    def __len__(self) -> int:
        return len(self.examples)

    def sample(self, n: int) -> list:
        batch = []
        while len(batch) < n:
            if not self._order:
                self._order = list(range(len(self.examples)))
                self.rng.shuffle(self._order)
            batch.append(self.examples[self._order.pop()])
        return batch


def build_datasets(data_cfg, tokenizer=None):
    """-> (tokenizer, train examples, held-out examples, stats). Everything is validated here."""
    tokenizer = tokenizer or load_tokenizer(data_cfg.tokenizer)
    if data_cfg.task == "addition":
        train_pairs, eval_pairs = addition_examples(data_cfg.num_digits, data_cfg.train_size,
                                                    data_cfg.eval_size, data_cfg.seed)
        where_train = where_eval = "addition task"
    else:
        train_pairs = load_examples(data_cfg.train_path, data_cfg.prompt_key, data_cfg.answer_key)
        where_train = data_cfg.train_path
        if data_cfg.eval_path:
            eval_pairs = load_examples(data_cfg.eval_path, data_cfg.prompt_key, data_cfg.answer_key)
            where_eval = data_cfg.eval_path
        else:
            if len(train_pairs) <= data_cfg.eval_size:
                raise DataError(f"{data_cfg.train_path}: {len(train_pairs)} rows cannot give data.eval_size = "
                                f"{data_cfg.eval_size} held-out rows and still leave training rows")
            rng = random.Random(data_cfg.seed)
            train_pairs = list(train_pairs)
            rng.shuffle(train_pairs)
            eval_pairs, train_pairs = train_pairs[:data_cfg.eval_size], train_pairs[data_cfg.eval_size:]
            where_eval = f"{data_cfg.train_path} (held-out split)"
    held_out, eval_long = encode_examples(eval_pairs, tokenizer, data_cfg.max_prompt_tokens, True, where_eval)
    train, train_long = encode_examples(train_pairs, tokenizer, data_cfg.max_prompt_tokens,
                                        data_cfg.drop_long_prompts, where_train, already_long=eval_long)
    if eval_long and not data_cfg.drop_long_prompts:
        encode_examples(eval_pairs, tokenizer, data_cfg.max_prompt_tokens, False, where_eval, train_long)
    for ex in train[:50]:
        n = len(tokenizer.encode(ex.answer)) + 1
        if n > data_cfg.max_response_tokens:
            raise DataError(f"{where_train}: answer {ex.answer!r} needs {n} tokens with eos but "
                            f"data.max_response_tokens = {data_cfg.max_response_tokens}")
    stats = {"train_examples": len(train), "eval_examples": len(held_out),
             "dropped_long_prompts": train_long + eval_long}
    return tokenizer, train, held_out, stats
