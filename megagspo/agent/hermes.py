"""Qwen3's Hermes tool-call format: the assistant writes each call in its text as

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

one block per call, possibly several in one turn, possibly after some text. `parse_tool_calls` splits a turn into
its text, its well-formed calls and one short message per malformed block (the agent tells the model what was
wrong instead of dropping the call silently); `format_tool_call` writes a call, in Qwen3's layout or the compact
one of the built-in character tokenizer.

The model's text is not trusted: a block's JSON goes through the project's bounded reader (moe.json_files: depth
limited, one-line errors), a block over MAX_CALL_BYTES is refused unread, and a message shows only the start of
what the model wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from moe.json_files import JsonFileError, loads_bounded

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_BYTES = 64 * 1024  # one call's JSON; a real call is well under 1 KiB
SHOWN_CHARS = 80            # of the model's text quoted back in a malformed call's message


@dataclass(frozen=True)
class ToolCallRequest:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    content: str                                                # the text outside the tool-call blocks, stripped
    calls: List[ToolCallRequest] = field(default_factory=list)  # the well-formed calls, in order
    malformed: List[str] = field(default_factory=list)          # one short message per malformed block


def _shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def _json_kind(value) -> str:
    for kind, said in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return said
    return "null"


def _parse_call(body: str) -> Union[ToolCallRequest, str]:
    """The call in one block's text, or the message saying why it is malformed."""
    if len(body) > MAX_CALL_BYTES or len(body.encode("utf-8", "surrogatepass")) > MAX_CALL_BYTES:
        return f"a tool call longer than {MAX_CALL_BYTES} bytes: {_shown(body)}"
    try:
        call = loads_bounded(body.strip(), "a tool call")
    except JsonFileError as exc:  # "a tool call: not valid JSON (Expecting ',' delimiter at line 1 column 9)"
        return f"{exc}: {_shown(body)}"
    if not isinstance(call, dict):
        return f'a tool call must be a JSON object with "name" and "arguments", got {_json_kind(call)}'
    name = call.get("name")
    if name is None:
        return f'a tool call without a "name": {_shown(body)}'
    if not isinstance(name, str):
        return f'a tool call\'s "name" must be a string, got {_json_kind(name)}'
    if not name.strip():
        return f'a tool call with an empty "name": {_shown(body)}'
    if "arguments" not in call:
        return f'the call of {_shown(name)} has no "arguments" (use {{}} for none)'
    arguments = call["arguments"]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string holding the object
        try:
            arguments = loads_bounded(arguments, f"the arguments of {_shown(name)}", want=dict)
        except JsonFileError as exc:
            return str(exc)
    if not isinstance(arguments, dict):
        return f'the "arguments" of {_shown(name)} must be a JSON object, got {_json_kind(arguments)}'
    return ToolCallRequest(name, arguments)


def _next_block(text: str, pos: int) -> Tuple[int, Optional[str], int, Optional[str]]:
    """From `pos`: (where the next block or stray tag starts, its body or None, where scanning resumes, the
    malformed-tag message or None); start == len(text) when nothing is left."""
    open_at, close_at = text.find(TOOL_CALL_OPEN, pos), text.find(TOOL_CALL_CLOSE, pos)
    if open_at == -1 and close_at == -1:
        return len(text), None, len(text), None
    if open_at == -1 or (close_at != -1 and close_at < open_at):
        return close_at, None, close_at + len(TOOL_CALL_CLOSE), f"a {TOOL_CALL_CLOSE} without its {TOOL_CALL_OPEN}"
    body_at = open_at + len(TOOL_CALL_OPEN)
    close_at, reopen_at = text.find(TOOL_CALL_CLOSE, body_at), text.find(TOOL_CALL_OPEN, body_at)
    if close_at == -1 or (reopen_at != -1 and reopen_at < close_at):
        end = len(text) if close_at == -1 else reopen_at  # the next <tool_call> starts a block of its own
        return open_at, None, end, (f"a {TOOL_CALL_OPEN} without its {TOOL_CALL_CLOSE}: "
                                    f"{_shown(text[body_at:end])}")
    return open_at, text[body_at:close_at], close_at + len(TOOL_CALL_CLOSE), None


def parse_tool_calls(text: str) -> ParsedTurn:
    """The assistant turn `text` split into its text, its well-formed calls (in order) and one message per
    malformed block: an unclosed <tool_call> (its text up to the next block is the broken call, not content), a
    stray </tool_call>, invalid JSON, a non-object, a missing or non-string "name", "arguments" missing or not
    an object (a JSON string holding an object is accepted), a block over MAX_CALL_BYTES."""
    pieces, calls, malformed, pos = [], [], [], 0
    while pos < len(text):
        start, body, pos_after, tag_problem = _next_block(text, pos)
        pieces.append(text[pos:start])
        pos = pos_after
        if tag_problem is not None:
            malformed.append(tag_problem)
        elif body is not None:
            call = _parse_call(body)
            (calls if isinstance(call, ToolCallRequest) else malformed).append(call)
    return ParsedTurn("".join(pieces).strip(), calls, malformed)


def format_tool_call(name: str, arguments: dict, compact: bool = False) -> str:
    """One call as the model writes it: Qwen3's layout (a newline inside each tag, json.dumps' default
    separators) or, `compact`, one line without spaces (the built-in character tokenizer's form). A tag inside
    a string is escaped (`\\u003c`, `<\\/`; the same JSON value), so that parse_tool_calls reads the call back."""
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise TypeError(f"format_tool_call: name must be a str and arguments a dict, got "
                        f"{type(name).__name__} and {type(arguments).__name__}")
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False,
                      separators=(",", ":") if compact else None)
    # outside strings JSON has no '<': these only rewrite string contents, to escapes of the same characters
    body = body.replace(TOOL_CALL_OPEN, "\\u003ctool_call>").replace(TOOL_CALL_CLOSE, "<\\/tool_call>")
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}" if compact else f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


__all__ = ["MAX_CALL_BYTES", "ParsedTurn", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCallRequest", "format_tool_call",
           "parse_tool_calls"]
