"""Tokenizers: a built-in character-level one for the synthetic task, or a local HF tokenizer folder.

Both expose: vocab_size, pad_id, bos_id (None where the tokenizer has none, as Qwen3's), eos_id (the token
that ends a demonstration), eos_ids (every token that ends a generated response: the tokenizer's eos plus
`generation_config.json`'s eos_token_id list), prompt_format ("chat" or "plain"), prompt_ids(prompt) -> the
model's input ids for one prompt (a string, or a chat message list under the chat format), encode(str) ->
list[int] (no special tokens), decode(list[int]) -> str (stops at the first of eos_ids, skips special tokens)
and decode_with_specials(list[int]) -> str (every token, specials as written: lossless, for the agent's prefix check).
"""

from __future__ import annotations

import os
from typing import NoReturn, Union

from megagspo.errors import first_line
from megagspo.errors import show_value as _show
from moe.json_files import read_json

PROMPT_FORMATS = ("auto", "chat", "plain")
BUILTIN_TOKENIZERS = ("builtin", "builtin_tools")  # data.tokenizer values that name no folder

# Files a Hugging Face tokenizer folder holds: tokenizer.json (fast tokenizers), or a tokenizer_config.json
# with the slow tokenizer's vocabulary files beside it.
# The JSON files of a model / tokenizer folder that transformers reads when it loads the tokenizer.
_FOLDER_JSON = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "generation_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def has_tokenizer_files(path: str) -> bool:
    """True when `path` is a folder holding a Hugging Face tokenizer (any of its defining files)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


class BuiltinTokenizer:
    """Digits, arithmetic symbols and a space; ids 0..2 are <pad>, <bos>, <eos>. Plain prompts only.

    tools=True (the "builtin_tools" tokenizer, for a tiny tool-use job): the same ids 0..19 first, then every
    other printable ASCII character and "\n" (so tool error texts encode), then the tool tags and the word
    tokens of a compact Hermes call to the built-in `add` tool, merged as a BPE would have merged them.
    encode is a greedy longest match, and "<bos>", "<eos>", "<pad>" in the text are those specials (the
    builtin chat renderer, megagspo.agent.chat, writes them).
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*=() "
    TOOL_WORDS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                  '"name"', '"arguments"', '"add"', '"a"', '"b"')

    def __init__(self, prompt_format: str = "auto", tools: bool = False) -> None:
        if prompt_format == "chat":
            raise ValueError("data.prompt_format = 'chat' needs a tokenizer with a chat template; the built-in "
                             "tokenizer has none (use data.tokenizer=<local HF tokenizer folder>)")
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        if tools:  # appended after ids 0..19: the plain tokenizer's ids (and a golden test's metrics) stay put
            printable = [chr(c) for c in range(0x20, 0x7F) if chr(c) not in self.CHARS]
            self.itos += printable + ["\n"] + list(self.TOOL_WORDS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.tools = tools
        # multi-character tokens, longest first: the greedy match tries them before single characters
        self._words = sorted((t for t in self.itos if len(t) > 1), key=len, reverse=True) if tools else []
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)
        self.prompt_format = "plain"

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        if not self.tools:
            try:
                return [self.stoi[c] for c in text]
            except KeyError as exc:
                self._unknown(text, text.index(exc.args[0]))
        ids, at = [], 0
        while at < len(text):
            word = next((w for w in self._words if text.startswith(w, at)), None)
            if word is None and text[at] not in self.stoi:
                self._unknown(text, at)
            word = word or text[at]
            ids.append(self.stoi[word])
            at += len(word)
        return ids

    def _unknown(self, text: str, at: int) -> NoReturn:
        # the text is shown cut to 200 characters: a prompt may be megabytes long
        shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text)} characters)"
        knows = "printable ASCII and newline" if self.tools else repr(self.CHARS)
        raise ValueError(f"built-in tokenizer cannot encode character {text[at]!r} (first at character {at}) in "
                         f"{shown}; it knows {knows} (use data.tokenizer=<local HF tokenizer folder>)") from None

    def prompt_ids(self, prompt) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError("the built-in tokenizer takes string prompts, not chat messages (it has no chat "
                             "template; use data.tokenizer=<local HF tokenizer folder>)")
        return [self.bos_id] + self.encode(prompt)

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id) or i >= len(self.itos):
                continue
            out.append(self.itos[i])
        return "".join(out)

    def decode_with_specials(self, ids) -> str:
        """Every token's text, specials as written, past any eos: the lossless view a prefix check compares."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.itos):
                raise ValueError(f"token id {i} lies outside the built-in tokenizer's {len(self.itos)} ids")
            out.append(self.itos[i])
        return "".join(out)


def _generation_config(path: str) -> dict:
    """generation_config.json of the folder ({} when absent); a broken one is an error naming it."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    return read_json(file)  # a JsonFileError (ValueError) naming the file when it cannot be trusted


def _token_ids(value, where: str) -> list[int]:
    """An int or a list of ints (generation_config's eos_token_id / pad_token_id) as a list."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where} must be a token id or a list of token ids, got {_show(value)}")
    return values


def _check_tools(tools) -> list[dict] | None:
    """The tool schemas a chat template renders (OpenAI / Qwen3: {"type": "function", "function": {...}})."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"tools must be a list of tool schemas (dicts), got {_show(tools)}")
    return [dict(t) for t in tools]


class HFTokenizer:
    """A local Hugging Face tokenizer folder (no downloads), with its chat template and generation config.

    tools: tool schemas the chat template renders into every chat prompt (Qwen3: the system block's <tools>).
    """

    def __init__(self, path: str, prompt_format: str = "auto", chat_template_kwargs: dict | None = None,
                 tools: list[dict] | None = None) -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"data.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer folder {path!r} does not exist")
        if not has_tokenizer_files(path):
            raise ValueError(f"tokenizer folder {path!r} holds no tokenizer: expected tokenizer.json, or "
                             f"tokenizer_config.json with its vocabulary files ({', '.join(_TOKENIZER_FILES[2:])})")
        from transformers import AutoTokenizer

        for name in _FOLDER_JSON:  # transformers parses these unbounded: each passes the bounded reader first
            if os.path.isfile(os.path.join(path, name)):
                read_json(os.path.join(path, name))  # JsonFileError (a ValueError) naming the file
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types; each becomes one clear error
            raise ValueError(f"tokenizer folder {path!r} could not be loaded ({type(exc).__name__}: "
                             f"{first_line(exc, 200)}); expected tokenizer.json, or tokenizer_config.json with its "
                             "vocabulary files") from None
        specials = set(self.tok.all_special_ids)
        if len(self.tok) <= len(specials):
            raise ValueError(f"tokenizer folder {path!r} has no vocabulary besides its {len(specials)} special "
                             "token(s): its vocabulary file is missing or empty")
        gen = _generation_config(path)
        gen_file = os.path.join(path, "generation_config.json")
        own_eos = [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]
        eos_ids = list(dict.fromkeys(own_eos + _token_ids(gen.get("eos_token_id"), f"{gen_file}: eos_token_id")))
        if not eos_ids:
            raise ValueError(f"tokenizer {path!r} has no eos token (neither its eos_token nor "
                             "generation_config.json's eos_token_id): responses could never end")
        if any(i >= len(self.tok) for i in eos_ids):
            outside = [i for i in eos_ids if i >= len(self.tok)]
            raise ValueError(f"{gen_file}: eos_token_id {outside[:8]}{' ...' if len(outside) > 8 else ''} lies "
                             f"outside the tokenizer's {len(self.tok)} ids ({len(outside)} of {len(eos_ids)} ids)")
        self.eos_ids = tuple(eos_ids)
        self.eos_id = eos_ids[0]  # the tokenizer's own eos ends a demonstration (SFT)
        gen_pad = _token_ids(gen.get("pad_token_id"), f"{gen_file}: pad_token_id")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else \
            (gen_pad[0] if gen_pad else self.eos_id)
        # bos_id is what the rollout engine's config names: the tokenizer's own, None when it has none (Qwen3);
        # prompts carry a bos only where the tokenizer's special-token rule or chat template adds one.
        self.bos_id = self.tok.bos_token_id
        has_template = bool(getattr(self.tok, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise ValueError(f"data.prompt_format = 'chat' but tokenizer {path!r} has no chat template")
        self.prompt_format = "chat" if prompt_format == "chat" or (prompt_format == "auto" and has_template) \
            else "plain"
        self.path = path
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tools = _check_tools(tools)
        if self.tools is not None and self.prompt_format == "plain":
            raise ValueError(f"tools are given but tokenizer {path!r} formats prompts as plain text: tool schemas "
                             "are rendered by a chat template (use data.prompt_format = 'chat' with a tokenizer "
                             "that has one)")

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def prompt_ids(self, prompt) -> list[int]:
        """Chat format: the template applied to the messages (a string prompt is one user message) with the
        generation prompt added. Plain format: the string with the tokenizer's own special tokens (e.g. a bos)."""
        if self.prompt_format == "plain":
            if not isinstance(prompt, str):
                raise ValueError("chat-message prompts need data.prompt_format = 'chat' (or 'auto' with a "
                                 "tokenizer that has a chat template)")
            return self.tok.encode(prompt, add_special_tokens=True)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        return self.tok.encode(self.render_chat(messages, True, self.tools), add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The chat template's text for `messages` (with data.chat_template_kwargs, and `tools` when given)."""
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **extra, **self.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error (jinja) names the problem; keep it
            raise ValueError(f"the chat template failed on this prompt: {type(exc).__name__}: {exc}") from None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        ends = [ids.index(e) for e in self.eos_ids if e in ids]
        if ends:
            ids = ids[:min(ends)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def decode_with_specials(self, ids) -> str:
        """Every token's text, specials as written, past any eos: the lossless view a prefix check compares."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


# Either tokenizer: the run's one interface (encode, decode, pad_id, eos_id, render)
Tokenizer = Union[BuiltinTokenizer, HFTokenizer]


def load_tokenizer(spec: str, prompt_format: str = "auto", chat_template_kwargs: dict | None = None,
                   tools: list[dict] | None = None):
    """The tokenizer data.tokenizer names: "builtin", "builtin_tools" (the built-in one with tool tokens) or a
    local HF tokenizer folder.

    tools: schemas an HF chat template renders into prompts; "builtin_tools" takes them but renders none (its
    tiny model learns its one tool from demonstrations); plain "builtin" has no tokens to call a tool with.
    """
    if spec in BUILTIN_TOKENIZERS:
        if chat_template_kwargs:
            raise ValueError("data.chat_template_kwargs is set, but the built-in tokenizer has no chat template")
        if spec == "builtin" and tools is not None:
            raise ValueError("tools are given, but the 'builtin' tokenizer has no tool tokens (use "
                             "data.tokenizer=builtin_tools, or a local HF tokenizer folder)")
        _check_tools(tools)
        return BuiltinTokenizer(prompt_format, tools=spec == "builtin_tools")
    return HFTokenizer(spec, prompt_format, chat_template_kwargs, tools)
