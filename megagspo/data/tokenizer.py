"""Tokenizers: a built-in character-level one for the synthetic task, or a local HF tokenizer folder.

Both expose: vocab_size, pad_id, bos_id, eos_id, encode(str) -> list[int] (no special tokens),
decode(list[int]) -> str (stops at eos, skips pad/bos).
"""

from __future__ import annotations

import os


class BuiltinTokenizer:
    """Digits, arithmetic symbols and a space; ids 0..2 are <pad>, <bos>, <eos>."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*=() "

    def __init__(self) -> None:
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"built-in tokenizer cannot encode character {exc.args[0]!r} in {text!r}; "
                             f"it knows {self.CHARS!r} (use data.tokenizer=<local HF tokenizer folder>)") from None

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


class HFTokenizer:
    """A local Hugging Face tokenizer folder (no downloads)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ValueError(f"tokenizer folder {path!r} does not exist")
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer {path!r} has no eos token")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(spec: str):
    return BuiltinTokenizer() if spec == "builtin" else HFTokenizer(spec)
