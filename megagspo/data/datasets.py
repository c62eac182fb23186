"""Prompt datasets: (prompt, answer) examples from JSONL / parquet or the synthetic task, tokenised and
checked before any compute.

A prompt is a string or a chat message list (`[{"role": "user", "content": ...}, ...]`), rendered by the
tokenizer (its chat template with the generation prompt, or plain text). The answer sits under
`answer_key`, which may be a dotted path into nested fields (`reward_model.ground_truth`); numbers are
taken as their text. Every problem is reported at load time with the file, row and field names: a missing
file, a row without the configured `prompt_key` / `answer_key` (the message lists the keys the row has),
values of the wrong type, and prompts longer than `max_prompt_tokens` (counted; an error unless
`drop_long_prompts`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

from moe.json_files import JsonFileError, loads_bounded

from .tasks import addition_examples, sloppy_demonstrations, tool_demonstrations
from .tokenizer import load_tokenizer


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and field."""


@dataclass(frozen=True)
class Example:
    prompt: object  # str, or a tuple of {"role", "content"} messages
    answer: str
    prompt_ids: tuple  # the model's input ids for the prompt (tokenizer.prompt_ids)
    # What the cold-start SFT imitates when it differs from `answer` (data.demo_drop_carry), or a tuple of assistant
    # turns (data.demo_tool_use: a tool call, then the answer); the reward and held-out accuracy always check `answer`.
    demonstration: str | tuple | None = None

    @property
    def demo(self):
        """The cold-start SFT's target: the demonstration where there is one, else the answer."""
        return self.answer if self.demonstration is None else self.demonstration


def _read_rows(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DataError(f"dataset file {path!r} does not exist")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"reading {path!r} needs pyarrow (pinned in requirements/base.txt; run make install)") \
                from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
        if not rows:
            raise DataError(f"dataset file {path!r} holds no rows")
        return rows
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:  # the project's one bounded JSON reader (moe.json_files): depth-limited, one-line errors
                row = loads_bounded(line, f"{path}:{lineno}")
            except JsonFileError as exc:
                raise DataError(str(exc)) from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise DataError(f"dataset file {path!r} holds no rows")
    return rows


def _field(row: dict, key: str):
    """row[key], or the value at a dotted path into nested mappings; KeyError when absent."""
    if key in row:
        return row[key]
    node = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def _check_messages(prompt, where: str) -> tuple:
    """A chat message list as a tuple of {"role", "content"} dicts, or DataError naming what is wrong."""
    if not prompt:
        raise DataError(f"{where}: the message list is empty")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {j} must be an object with string 'role' and 'content', got "
                            f"{_shorten(message)}")
    return tuple({"role": m["role"], "content": m["content"]} for m in prompt)


def _shorten(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def load_examples(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[tuple]:
    """[(prompt, answer)]: prompt a string or a tuple of chat messages, answer a string."""
    pairs = []
    for i, row in enumerate(_read_rows(path)):
        values = []
        for key, option in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
            try:
                values.append(_field(row, key))
            except KeyError:
                raise DataError(f"{path}: row {i} has no field {key!r} (data.{option}); the row's fields are "
                                f"{sorted(row)}") from None
        prompt, answer = values
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if isinstance(prompt, list):
            prompt = _check_messages(prompt, f"{path}: row {i}: {prompt_key!r}")
        if not isinstance(prompt, (str, tuple)) or not isinstance(answer, str):
            raise DataError(f"{path}: row {i}: {prompt_key!r} must be a string or a chat message list and "
                            f"{answer_key!r} a string or number, got {type(prompt).__name__} and "
                            f"{type(answer).__name__}")
        pairs.append((prompt, answer))
    return pairs


def encode_examples(pairs, tokenizer, max_prompt_tokens: int, drop_long: bool, where: str,
                    already_long: int = 0, rows=None, allow_empty: bool = False) -> tuple[list, int]:
    """-> (examples, number of prompts over the limit). Too-long prompts raise unless drop_long; the error
    counts them together with `already_long` found in the other split(s). `rows`: each pair's row in its file
    (for messages; default 0, 1, ...). allow_empty: no prompt left is the caller's to judge (a first pass that
    only counts: its drop_long is not the user's setting, so an error here would describe a setting nobody
    made)."""
    out, too_long = [], []
    rows = range(len(pairs)) if rows is None else rows
    for i, (prompt, answer) in zip(rows, pairs):
        try:
            ids = tuple(tokenizer.prompt_ids(prompt))
        except ValueError as exc:
            raise DataError(f"{where}: row {i}: {exc}") from None
        if not ids:
            raise DataError(f"{where}: row {i}: the prompt encodes to no tokens")
        if len(ids) > max_prompt_tokens:
            too_long.append((i, len(ids)))
            continue
        out.append(Example(prompt, answer, ids))
    if too_long and not drop_long:
        shown = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:5])
        raise DataError(
            f"{where}: {len(too_long) + already_long} of {len(pairs) + already_long} prompts are longer than "
            f"data.max_prompt_tokens = {max_prompt_tokens} (as the model sees them: bos / chat template "
            f"included): {shown}{' ...' if len(too_long) > 5 else ''}; raise the limit or "
            "set data.drop_long_prompts=true to drop them")
    if not out and not allow_empty:
        why = (f"all {len(too_long)} prompts are longer than data.max_prompt_tokens = {max_prompt_tokens} and "
               "data.drop_long_prompts=true dropped them; raise the limit") if too_long else "it holds no prompts"
        raise DataError(f"{where}: no usable prompts: {why}")
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

    def state_dict(self) -> dict:
        """The sampler's position: its RNG and what is left of the current epoch's order (JSON-able)."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self._order)}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._order = list(state["order"])


# Rewards that score the response as a whole against the answer (not an answer found in free text): an
# answer longer than data.max_response_tokens could never earn the full score.
WHOLE_ANSWER_REWARDS = ("exact_match", "digit_match")
RESPONSE_CHECKS = (None, "sft", "reward")


def response_check_for(sft_steps: int, reward_name: str):
    """Which answers data.max_response_tokens limits: "sft" (cold-start SFT trains on prompt -> answer + eos
    demonstrations of the training split), "reward" (no SFT, a reward in WHOLE_ANSWER_REWARDS: the response
    must be the answer, train and held-out), or None (no SFT, a reward that reads a final answer out of free
    text: the gold answer's length limits nothing)."""
    if sft_steps:
        return "sft"
    return "reward" if reward_name in WHOLE_ANSWER_REWARDS else None


def check_response_lengths(examples, tokenizer, max_response_tokens: int, where: str, check: str) -> None:
    """Every answer that `check` limits (response_check_for) against data.max_response_tokens: all rows, not a
    sample. DataError counts the answers over the limit and shows the longest."""
    if check not in RESPONSE_CHECKS:
        raise ValueError(f"response check must be one of {RESPONSE_CHECKS}, got {check!r}")
    if check is None:
        return
    extra = 1 if check == "sft" else 0  # a demonstration ends with the eos token
    over = []
    for ex in examples:
        # a multi-turn demonstration: each assistant turn is one response (data.max_response_tokens per turn)
        texts = ([ex.demo] if isinstance(ex.demo, str) else list(ex.demo)) if check == "sft" else [ex.answer]
        n, text = max((len(tokenizer.encode(t)) + extra, t) for t in texts)
        if n > max_response_tokens:
            over.append((n, text))
    if over:
        n, answer = max(over, key=lambda item: item[0])
        what = "SFT demonstrations (answer + eos; sft.steps > 0)" if check == "sft" else \
            f"responses the reward compares whole ({', '.join(WHOLE_ANSWER_REWARDS)})"
        raise DataError(f"{where}: {len(over)} of {len(examples)} answers are longer than data.max_response_tokens "
                        f"= {max_response_tokens} tokens as {what}; the longest, {_shorten(answer)}, needs {n}: "
                        "raise data.max_response_tokens or leave these rows out")


def build_datasets(data_cfg, tokenizer=None, response_check="sft"):
    """-> (tokenizer, train examples, held-out examples, stats). Everything is validated here. `response_check`
    (response_check_for): which answers data.max_response_tokens must hold; "sft" checks the training split's.
    An eval file longer than data.eval_size is cut to a fixed subset: data.eval_size rows drawn with data.seed,
    in file order (set data.eval_size to the file's row count to evaluate on all of it)."""
    tokenizer = tokenizer or load_tokenizer(data_cfg.tokenizer, data_cfg.prompt_format, data_cfg.chat_template_kwargs)
    eval_rows = None  # the held-out pairs' rows in their file, where they are a subset of it
    stats_extra = {}
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
            stats_extra["eval_file_rows"] = len(eval_pairs)
            if len(eval_pairs) > data_cfg.eval_size:
                eval_rows = sorted(random.Random(data_cfg.seed).sample(range(len(eval_pairs)), data_cfg.eval_size))
                eval_pairs = [eval_pairs[i] for i in eval_rows]
                where_eval = f"{data_cfg.eval_path} (data.eval_size = {data_cfg.eval_size} of its " \
                             f"{stats_extra['eval_file_rows']} rows)"
        else:
            if len(train_pairs) <= data_cfg.eval_size:
                raise DataError(f"{data_cfg.train_path}: {len(train_pairs)} rows cannot give data.eval_size = "
                                f"{data_cfg.eval_size} held-out rows and still leave training rows")
            rng = random.Random(data_cfg.seed)
            train_pairs = list(train_pairs)
            rng.shuffle(train_pairs)
            eval_pairs, train_pairs = train_pairs[:data_cfg.eval_size], train_pairs[data_cfg.eval_size:]
            where_eval = f"{data_cfg.train_path} (held-out split)"
    # The held-out split is first only counted (its too-long prompts join the training split's count in one
    # error); every error below then speaks of the user's own data.drop_long_prompts.
    held_out, eval_long = encode_examples(eval_pairs, tokenizer, data_cfg.max_prompt_tokens, True, where_eval,
                                          rows=eval_rows, allow_empty=True)
    train, train_long = encode_examples(train_pairs, tokenizer, data_cfg.max_prompt_tokens,
                                        data_cfg.drop_long_prompts, where_train, already_long=eval_long)
    if (eval_long and not data_cfg.drop_long_prompts) or not held_out:
        encode_examples(eval_pairs, tokenizer, data_cfg.max_prompt_tokens, data_cfg.drop_long_prompts, where_eval,
                        train_long, rows=eval_rows)
    if data_cfg.task == "addition" and (data_cfg.demo_drop_carry or data_cfg.demo_tool_use):
        pairs = [(ex.prompt, ex.answer) for ex in train]
        demos = sloppy_demonstrations(pairs, data_cfg.demo_drop_carry, data_cfg.seed)
        if data_cfg.demo_tool_use:
            demos = tool_demonstrations(pairs, demos, data_cfg.demo_tool_use, data_cfg.seed)
            stats_extra["tool_demonstrations"] = sum(isinstance(d, tuple) for d in demos)
        stats_extra["sloppy_demonstrations"] = sum(isinstance(d, str) and d != ex.answer for ex, d in zip(train, demos))
        train = [replace(ex, demonstration=d) if d != ex.answer else ex for ex, d in zip(train, demos)]
    check_response_lengths(train, tokenizer, data_cfg.max_response_tokens, where_train, response_check)
    if response_check == "reward":
        check_response_lengths(held_out, tokenizer, data_cfg.max_response_tokens, where_eval, response_check)
    stats = {"train_examples": len(train), "eval_examples": len(held_out),
             "dropped_long_prompts": train_long + eval_long, **stats_extra}
    return tokenizer, train, held_out, stats
