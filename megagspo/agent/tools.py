"""Typed Python functions as tools: the JSON schema the model is shown comes from the function's signature and
docstring, a registry names them, and ToolCaller runs the model's calls.

A tool is a plain function with a type hint on every parameter and a Google-style docstring: the first paragraph
is the description, the "Args:" section the parameters' descriptions. Built from the function rather than written
by hand, the schema cannot drift from what the function accepts.

ToolCaller never raises for a tool's failure: an unknown tool, arguments that do not fit the schema, an exception,
a result that is not JSON and a call past its time limit all come back as a ToolResult whose text the model reads
as the tool's response (short: it lands in the context) and whose `error` names the kind, for the rollout's
counts. A tool marked `fn.in_process = True` (it cannot hang: linear-time pure Python) runs in the caller's thread;
every other one runs in its own worker process, SIGKILLed at its deadline and restarted for the next call, the
verifier's mechanism (megagspo.rewards.bounded).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import types
import typing
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megagspo.rewards.bounded import BoundedCall, CallCrashed, CallTimeout

TOOL_ERRORS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
MAX_ERROR_LINE = 300  # characters of an exception's first line the model is shown
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the OpenAI / Qwen3 function-name rule
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")


class ToolDefinitionError(ValueError):
    """A function that cannot be a tool; the message names the function and why."""


class ToolResultNotJson(TypeError):
    """A tool returned a value json.dumps cannot write (raised where the tool ran, worker or caller)."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    description: str  # the docstring's first paragraph
    parameters: dict  # JSON schema: {"type": "object", "properties": {...}, "required": [...]}
    in_process: bool  # fn.in_process is True: runs in the caller (it cannot hang); else in a time-limited worker
    # Optional parameters without a default: passed None when the model leaves them out (else fn would raise)
    none_if_missing: Tuple[str, ...] = field(default=(), repr=False)

    def schema(self) -> dict:
        """The entry of the chat template's `tools` list (OpenAI / Qwen3 form)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _json_type(fn_name: str, param: str, hint) -> Tuple[dict, bool]:
    """(the JSON schema of `hint`, whether it allows None); ToolDefinitionError for a type JSON cannot carry."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise ToolDefinitionError(f"tool function {fn_name!r}: parameter {param!r} has the union type {hint}; "
                                      "a tool takes one type per parameter (Optional[X] is allowed)")
        schema, _ = _json_type(fn_name, param, inner[0])
        return schema, True
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}, False
    if origin in (list, dict) and not args:  # typing.List, typing.Dict without parameters
        return {"type": _JSON_TYPES[origin]}, False
    if origin is list and len(args) == 1:
        items, nullable = _json_type(fn_name, param, args[0])
        if nullable:
            raise ToolDefinitionError(f"tool function {fn_name!r}: parameter {param!r} is a list of optional "
                                      "values; a tool's list items have one type")
        return {"type": "array", "items": items}, False
    if origin is dict:
        return {"type": "object"}, False
    raise ToolDefinitionError(f"tool function {fn_name!r}: parameter {param!r} has the type {hint}, which JSON "
                              "cannot carry (use int, float, str, bool, list, list[X], dict or Optional[X])")


def _docstring_parts(fn_name: str, doc: Optional[str]) -> Tuple[str, Dict[str, str]]:
    """(the first paragraph, {parameter: description} from the Args: section) of a Google-style docstring."""
    text = inspect.cleandoc(doc or "")
    if not text.strip():
        raise ToolDefinitionError(f"tool function {fn_name!r} has no docstring; its first paragraph is the "
                                  "description the model reads")
    lines = text.splitlines()
    paragraph = []
    for line in lines:
        if not line.strip() or line.strip() in _ARGS_HEADERS:
            break
        paragraph.append(line.strip())
    if not paragraph:
        raise ToolDefinitionError(f"tool function {fn_name!r}: its docstring has no description before its "
                                  "Args: section")
    described, current, section_indent = {}, None, None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if section_indent is None:
            if stripped in _ARGS_HEADERS:
                section_indent = indent
            continue
        if not stripped:
            continue
        if indent <= section_indent:  # the next section (Returns:, Raises:) ends Args:
            break
        entry = re.match(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
        if entry and (current is None or indent <= current[1]):
            current = (entry.group(1), indent)
            described[current[0]] = entry.group(2).strip()
        elif current is not None:  # a continuation line of the entry above
            described[current[0]] = f"{described[current[0]]} {stripped}".strip()
    return " ".join(paragraph), described


def tool_from_function(fn: Callable, name: Optional[str] = None) -> Tool:
    """The Tool of `fn`: its schema from the signature's type hints and the docstring. ToolDefinitionError
    (naming the function and why) for a parameter without a type hint or of a type JSON cannot carry, *args /
    **kwargs, a positional-only parameter (a tool is called by keyword), or no docstring."""
    fn_name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise ToolDefinitionError(f"tool {fn_name!r} is not callable")
    tool_name = name if name is not None else getattr(fn, "__name__", "")
    if not isinstance(tool_name, str) or not _TOOL_NAME.match(tool_name):
        raise ToolDefinitionError(f"tool function {fn_name!r}: the tool name {tool_name!r} must be 1 to 64 "
                                  "letters, digits, '_' or '-'")
    description, described = _docstring_parts(fn_name, getattr(fn, "__doc__", None))
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as exc:
        raise ToolDefinitionError(f"tool function {fn_name!r}: its signature cannot be read ({exc})") from None
    properties, required, none_if_missing = {}, [], []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool function {fn_name!r}: parameter {param.name!r} is *args or **kwargs; "
                                      "a tool names each parameter")
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolDefinitionError(f"tool function {fn_name!r}: parameter {param.name!r} is positional-only; "
                                      "a tool is called by keyword")
        if param.name not in hints:
            raise ToolDefinitionError(f"tool function {fn_name!r}: parameter {param.name!r} has no type hint; "
                                      "the hint gives the schema's type")
        schema, nullable = _json_type(fn_name, param.name, hints[param.name])
        if param.name in described and described[param.name]:
            schema["description"] = described[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            (none_if_missing if nullable else required).append(param.name)
    unknown = sorted(set(described) - set(properties))
    if unknown:
        raise ToolDefinitionError(f"tool function {fn_name!r}: its docstring describes "
                                  f"{', '.join(map(repr, unknown))}, not in its signature")
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(tool_name, fn, description, parameters, getattr(fn, "in_process", False) is True,
                tuple(none_if_missing))


_TOOLS: Dict[str, Callable] = {}


def register_tool(name: Optional[str] = None):
    """Decorator: register the function as a tool named `name` (default: its __name__). The Tool is built here,
    so a bad definition fails at registration; `get_tool` builds it again, so a mark set after the decorator
    (`fn.in_process = True`, as the rewards do) counts."""

    def deco(fn):
        tool = tool_from_function(fn, name)
        if tool.name in _TOOLS:
            raise ValueError(f"tool {tool.name!r} is already registered")
        _TOOLS[tool.name] = fn
        return fn

    return deco


def available_tools() -> List[str]:
    return sorted(_TOOLS)


def get_tool(name: str) -> Tool:
    try:
        fn = _TOOLS[name]
    except KeyError:
        raise ValueError(f"unknown tool {name!r}; valid names: {', '.join(available_tools())}") from None
    return tool_from_function(fn, name)


@register_tool("add")
def add(a: int, b: int) -> int:
    """Add two integers and return their sum.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


add.in_process = True


@dataclass
class ToolResult:
    text: str              # what the model sees as the tool's response
    error: Optional[str]   # None, or one of TOOL_ERRORS


def result_text(value) -> str:
    """What the model sees of a tool's return value: a str as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        raise ToolResultNotJson(f"returned a {type(value).__name__}, which is not JSON") from None


def _json_name(value) -> str:
    """The JSON type of a value parsed from JSON, with its article, as the model's error texts say it."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"


def _fits(value, schema: dict) -> bool:
    kind = schema["type"]
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list) and ("items" not in schema or all(_fits(v, schema["items"]) for v in value))
    return isinstance(value, {"string": str, "boolean": bool, "object": dict}[kind])


_SAID = {"integer": ("an integer", "integers"), "number": ("a number", "numbers"), "string": ("a string", "strings"),
         "boolean": ("a boolean", "booleans"), "array": ("an array", "arrays"), "object": ("an object", "objects")}


def _type_said(schema: dict, plural: bool = False) -> str:
    said = _SAID[schema["type"]][plural]
    return f"{said} of {_type_said(schema['items'], plural=True)}" if "items" in schema else said


def _shown(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def argument_problems(tool: Tool, arguments) -> List[str]:
    """What is wrong with `arguments` for `tool` (empty when they fit its schema), one short phrase each."""
    if not isinstance(arguments, dict):
        return [f"the arguments must be a JSON object, got {_json_name(arguments)}"]
    properties, problems = tool.parameters["properties"], []
    missing = [p for p in tool.parameters["required"] if p not in arguments]
    if missing:
        problems.append(f"missing the required parameter{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(repr, missing))}")
    unknown = [p for p in arguments if p not in properties]
    if unknown:
        problems.append(f"no parameter {', '.join(_shown(str(p), 40) for p in unknown[:5])}"
                        f"{' ...' if len(unknown) > 5 else ''}; its parameters are: {', '.join(properties) or 'none'}")
    for param, value in arguments.items():
        schema = properties.get(param)
        if schema is None or (value is None and param not in tool.parameters["required"]):
            continue  # unknown (said above), or null for an optional parameter: left out
        if not _fits(value, schema):
            problems.append(f"parameter {param!r} must be {_type_said(schema)}, got {_json_name(value)}")
    return problems


class ToolCaller:
    """Runs the model's tool calls on `tools`, each at most `timeout_s` seconds (the in-process ones excepted).
    Thread-safe: one rollout thread per trajectory calls it at once; each worker tool has one worker process,
    started at its first call, whose calls are serialised."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float) -> None:
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"ToolCaller: timeout_s must be > 0 (a tool's time limit), got {timeout_s}")
        self.tools: Dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"ToolCaller: two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.timeout_s = float(timeout_s)
        self._workers: Dict[str, BoundedCall] = {}
        self._lock = threading.Lock()  # guards _workers; each BoundedCall serialises its own calls
        self._closed = False

    def _worker(self, tool: Tool) -> BoundedCall:
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolCaller: called after close()")
            if tool.name not in self._workers:
                self._workers[tool.name] = BoundedCall(tool.fn, self.timeout_s, convert=result_text, what=tool.name,
                                                       process_name=f"megagspo-tool-{tool.name}")
            return self._workers[tool.name]

    def _run(self, tool: Tool, arguments: dict) -> str:
        kwargs = {k: v for k, v in arguments.items() if v is not None or k in tool.parameters["required"]}
        kwargs.update({p: None for p in tool.none_if_missing if p not in kwargs})
        if tool.in_process:
            return result_text(tool.fn(**kwargs))
        return self._worker(tool)(**kwargs)

    def call(self, name: str, arguments) -> ToolResult:
        """The tool's response text, or an error text the model reads (never raises for the tool's failure;
        RuntimeError after close())."""
        if self._closed:
            raise RuntimeError("ToolCaller: called after close()")
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: unknown tool {_shown(str(name), 64)}; the tools are: "
                              f"{', '.join(self.tools) or 'none'}", "unknown_tool")
        problems = argument_problems(tool, arguments)
        if problems:
            return ToolResult(f"error: bad arguments for {name}: {'; '.join(problems)}", "bad_arguments")
        try:
            return ToolResult(self._run(tool, arguments), None)
        except CallTimeout:
            return ToolResult(f"error: {name} ran past its time limit of {self.timeout_s:g} s", "timeout")
        except CallCrashed as exc:  # "<name>'s worker process died mid-call (exit code -11)"
            return ToolResult(f"error: {str(exc)[:MAX_ERROR_LINE]}", "raised")
        except ToolResultNotJson as exc:
            return ToolResult(f"error: {name} {exc}", "raised")
        except Exception as exc:  # noqa: BLE001 - the tool's own failure: the model reads it
            lines = str(exc).strip().splitlines()
            said = f": {lines[0][:MAX_ERROR_LINE]}" if lines else ""
            return ToolResult(f"error: {name} raised {type(exc).__name__}{said}", "raised")

    def close(self) -> None:
        """End the workers (a call after this raises RuntimeError)."""
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.close()

    def __enter__(self) -> "ToolCaller":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["TOOL_ERRORS", "Tool", "ToolCaller", "ToolDefinitionError", "ToolResult", "ToolResultNotJson",
           "available_tools", "get_tool", "register_tool", "tool_from_function"]
