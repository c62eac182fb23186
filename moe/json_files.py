"""The one reader of JSON from disk: size and nesting bounded, every failure one line naming the file.

Every JSON file the project reads (Hugging Face folders' config.json / generation_config.json / safetensors
index, torch_dist metadata.json, checkpoints' manifest.json and trainer_state.json, the KL reference's record,
run state, summaries) goes through `read_json` or, for one line of a JSONL file, `loads_bounded`. Nothing read
from disk is trusted: a file larger than `max_bytes`, nested deeper than `max_depth`, not UTF-8, not JSON, or
(with `want`) of another top-level type raises JsonFileError (a ValueError) naming the file, never a
RecursionError or a MemoryError. Standard library only, so that `moe/` (which never imports `megagspo`) and
`megagspo/` share it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

MAX_BYTES = 256 << 20  # a 30B model's safetensors index is ~2 MB, a trainer_state.json a few MB
MAX_DEPTH = 64         # the deepest file the project writes nests < 10 levels


class JsonFileError(ValueError):
    """A JSON file (or line) that cannot be trusted: the message is one line and names it."""


def _depth_exceeds(value, limit: int) -> bool:
    """True when `value` nests containers deeper than `limit` (iterative: no recursion of its own)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def loads_bounded(text, where: str, max_depth: int = MAX_DEPTH, want: Optional[type] = None):
    """json.loads(text) with the nesting bound; `where` names the file (and line) in the error."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonFileError(f"{where}: JSON nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError:
        raise JsonFileError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise JsonFileError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if _depth_exceeds(value, max_depth):
        raise JsonFileError(f"{where}: JSON nested deeper than {max_depth} levels")
    if want is not None and not isinstance(value, want):
        raise JsonFileError(f"{where}: expected a JSON {'object' if want is dict else want.__name__}, "
                            f"got {type(value).__name__}")
    return value


def read_json(path, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, want: Optional[type] = dict):
    """The JSON value in the file `path` (by default it must be an object). Raises JsonFileError naming the
    file when it is missing, unreadable, larger than `max_bytes`, not UTF-8, not JSON, nested deeper than
    `max_depth` or of another top-level type."""
    return read_json_text(path, max_bytes, max_depth, want)[1]


def read_bytes_bounded(path: str, max_bytes: int, error: type, what: str) -> bytes:
    """The bytes of `path`, at most `max_bytes` of them; `error` (naming the file) when it cannot be read or is
    larger. Shared by the bounded JSON and YAML readers."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes} bytes, the limit for {what}")
    return data


def read_json_text(path, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, want: Optional[type] = dict):
    """(the file's text, its JSON value) under read_json's checks, for a caller that copies the text as it is."""
    path = os.fspath(path)
    data = read_bytes_bounded(path, max_bytes, JsonFileError, "a JSON file")
    value = loads_bounded(data, path, max_depth, want)
    return data.decode("utf-8"), value
