"""Tools for multi-turn rollouts (issue 48): the schema a typed function gives, the definitions refused, the
caller's results and error texts (a hanging tool cut off at its limit and its worker restarted, a closure run in a
fork, many threads at once), and Qwen3's Hermes tool-call format parsed and written."""

import json
import os
import threading
import time
from typing import Dict, List, Optional

import pytest

from megagspo.agent import tools as tools_module
from megagspo.agent.hermes import (MAX_CALL_BYTES, ParsedTurn, ToolCallRequest, format_tool_call,
                                   parse_tool_calls)
from megagspo.agent.tools import (TOOL_ERRORS, ToolCaller, ToolDefinitionError, ToolResult,
                                  available_tools, get_tool, register_tool, tool_from_function)


# Module-level tools pickle by reference: their worker is a fresh interpreter (closures get a fork, below).
def search(query: str, limit: int = 5, exact: Optional[bool] = None, weights: List[float] = None,
           filters: Dict[str, str] = None, scale: float = 1.0) -> list:
    """Search the corpus for a query.

    Returns the best hits. This second paragraph is not part of the description.

    Args:
        query: the words to look for,
            over two lines
        limit (int): how many hits at most
        exact: match the words exactly
        weights: a weight per word

    Returns:
        the hits
    """
    return [query] * limit


def hangs(seconds: float) -> str:
    """Sleep, then say so (a tool that can hang).

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return f"slept {seconds:g} s"


def fails(text: str) -> str:
    """Raise a ValueError with the text.

    Args:
        text: the message
    """
    raise ValueError(f"{text}\nsecond line the model does not see")


def returns_a_set(n: int) -> str:
    """Return something JSON cannot write.

    Args:
        n: a number
    """
    return {n}


def square(x: int) -> dict:
    """The square of x, with x.

    Args:
        x: the number
    """
    return {"x": x, "square": x * x}


def maybe(x: Optional[int]) -> str:
    """Say whether x was given.

    Args:
        x: a number, or null
    """
    return "none" if x is None else f"x={x}"


@pytest.fixture
def caller():
    made = ToolCaller([tool_from_function(f) for f in (search, hangs, fails, returns_a_set, square, maybe)]
                      + [get_tool("add")], timeout_s=1.0)
    yield made
    made.close()


@pytest.fixture
def registry():
    """The tool registry restored after the test (tests register throw-away tools)."""
    saved = dict(tools_module._TOOLS)
    yield
    tools_module._TOOLS.clear()
    tools_module._TOOLS.update(saved)


# ------------------------------------------------------------------------------------------ schema
def test_builtin_add_schema_exactly():
    add = get_tool("add")
    assert add.in_process and "add" in available_tools()
    assert add.schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers and return their sum.",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "description": "the first addend"},
                                      "b": {"type": "integer", "description": "the second addend"}},
                       "required": ["a", "b"]}}}
    assert add.fn(2, 3) == 5


def test_schema_from_signature_and_docstring():
    tool = tool_from_function(search)
    assert tool.name == "search" and not tool.in_process
    assert tool.description == "Search the corpus for a query."
    assert tool.parameters == {"type": "object", "properties": {
        "query": {"type": "string", "description": "the words to look for, over two lines"},
        "limit": {"type": "integer", "description": "how many hits at most"},
        "exact": {"type": "boolean", "description": "match the words exactly"},
        "weights": {"type": "array", "items": {"type": "number"}, "description": "a weight per word"},
        "filters": {"type": "object"},          # undocumented: no description
        "scale": {"type": "number"},
    }, "required": ["query"]}
    assert tool_from_function(search, name="find").schema()["function"]["name"] == "find"

    def plain(xs: list, opt: "int | None", nested: list[list[int]]) -> None:
        """Bare list, a PEP 604 optional, a nested list."""

    props = tool_from_function(plain).parameters
    nested = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
    assert props["properties"] == {"xs": {"type": "array"}, "opt": {"type": "integer"}, "nested": nested}
    assert props["required"] == ["xs", "nested"]  # Optional without a default is not required either


def _no_hint(a, b: int) -> int:
    """No hint on a."""


def _star_args(*numbers: int) -> int:
    """Star args."""


def _star_kwargs(a: int, **options: str) -> int:
    """Star kwargs."""


def _no_doc(a: int) -> int:
    return a


def _set_type(items: set) -> int:
    """A set."""


def _union_type(x: "int | str") -> int:
    """A union."""


def _documents_a_ghost(a: int) -> int:
    """Typo in the docs.

    Args:
        b: not a parameter
    """


@pytest.mark.parametrize("fn, said", [
    (_no_hint, "'_no_hint': parameter 'a' has no type hint"),
    (_star_args, "'_star_args': parameter 'numbers' is *args or **kwargs"),
    (_star_kwargs, "'_star_kwargs': parameter 'options' is *args or **kwargs"),
    (_no_doc, "'_no_doc' has no docstring"),
    (_set_type, "'_set_type': parameter 'items' has the type <class 'set'>, which JSON cannot carry"),
    (_union_type, "'_union_type': parameter 'x' has the union type"),
    (_documents_a_ghost, "'_documents_a_ghost': its docstring describes 'b', not in its signature"),
    (lambda x: x, "the tool name '<lambda>' must be 1 to 64"),
])
def test_definition_errors_name_the_function_and_why(fn, said):
    with pytest.raises(ToolDefinitionError) as info:
        tool_from_function(fn)
    assert said in str(info.value), str(info.value)


def test_register_get_and_duplicates(registry):
    @register_tool("shout")
    def shout(text: str) -> str:
        """Upper-case the text.

        Args:
            text: what to shout
        """
        return text.upper()

    shout.in_process = True  # marked after the decorator, as the built-ins are: get_tool sees it
    assert "shout" in available_tools() and get_tool("shout").in_process
    with pytest.raises(ValueError, match="tool 'shout' is already registered"):
        register_tool("shout")(shout)
    with pytest.raises(ValueError, match="tool 'add' is already registered"):
        register_tool()(tools_module.add)
    with pytest.raises(ToolDefinitionError, match="'_no_doc' has no docstring"):
        register_tool("no_doc")(_no_doc)  # a bad definition fails at registration
    assert "no_doc" not in available_tools()
    with pytest.raises(ValueError, match="unknown tool 'mul'; valid names: .*add"):
        get_tool("mul")


# ------------------------------------------------------------------------------------------ caller
def test_results_are_text_or_json(caller):
    assert caller.call("add", {"a": 40, "b": 3}) == ToolResult("43", None)
    assert caller.call("square", {"x": 7}) == ToolResult('{"x": 7, "square": 49}', None)
    assert caller.call("hangs", {"seconds": 0}) == ToolResult("slept 0 s", None)
    assert caller.call("search", {"query": "é", "limit": 2, "exact": None}) == ToolResult('["é", "é"]', None)
    assert caller.call("maybe", {}) == ToolResult("none", None)           # Optional without default: None
    assert caller.call("maybe", {"x": None}) == ToolResult("none", None)  # null for an optional parameter
    assert caller.call("maybe", {"x": 2}) == ToolResult("x=2", None)
    assert set(TOOL_ERRORS) == {"malformed", "unknown_tool", "bad_arguments", "raised", "timeout"}


def test_unknown_tool_lists_the_tools(caller):
    got = caller.call("mul", {"a": 1})
    assert got.error == "unknown_tool"
    assert got.text == "error: unknown tool 'mul'; the tools are: search, hangs, fails, returns_a_set, square, " \
                       "maybe, add"


@pytest.mark.parametrize("name, arguments, said", [
    ("add", [1, 2], "the arguments must be a JSON object, got an array"),
    ("add", "a=1", "the arguments must be a JSON object, got a string"),
    ("add", {"a": 1}, "missing the required parameter 'b'"),
    ("add", {}, "missing the required parameters 'a', 'b'"),
    ("add", {"a": 1, "b": 2, "c": 3}, "no parameter 'c'; its parameters are: a, b"),
    ("add", {"a": True, "b": 2}, "parameter 'a' must be an integer, got a boolean"),
    ("add", {"a": 1.5, "b": 2}, "parameter 'a' must be an integer, got a number"),
    ("add", {"a": None, "b": 2}, "parameter 'a' must be an integer, got null"),
    ("search", {"query": 3}, "parameter 'query' must be a string, got an integer"),
    ("search", {"query": "q", "scale": False}, "parameter 'scale' must be a number, got a boolean"),
    ("search", {"query": "q", "exact": 1}, "parameter 'exact' must be a boolean, got an integer"),
    ("search", {"query": "q", "weights": [1, "x"]}, "parameter 'weights' must be an array of numbers, got an array"),
    ("search", {"query": "q", "filters": []}, "parameter 'filters' must be an object, got an array"),
])
def test_bad_arguments_say_what_is_wrong(caller, name, arguments, said):
    got = caller.call(name, arguments)
    assert got.error == "bad_arguments" and got.text == f"error: bad arguments for {name}: {said}", got.text


def test_number_accepts_integers(caller):
    assert caller.call("search", {"query": "q", "limit": 1, "scale": 2, "weights": [1, 2.5]}).error is None


def test_a_tool_that_raises_or_returns_no_json(caller):
    assert caller.call("fails", {"text": "no such file"}) == \
        ToolResult("error: fails raised ValueError: no such file", "raised")
    long = caller.call("fails", {"text": "x" * 1000})
    assert long.error == "raised" and long.text == "error: fails raised ValueError: " + "x" * 300
    assert caller.call("returns_a_set", {"n": 1}) == \
        ToolResult("error: returns_a_set returned a set, which is not JSON", "raised")


def test_a_hanging_tool_is_cut_at_its_limit_and_its_worker_restarted(caller):
    assert caller.call("hangs", {"seconds": 0}).error is None  # the worker's start is not timed
    t0 = time.perf_counter()
    got = caller.call("hangs", {"seconds": 60})
    took = time.perf_counter() - t0
    assert got == ToolResult("error: hangs ran past its time limit of 1 s", "timeout")
    assert took < 3.0, f"the cut-off call took {took:.1f} s (limit 1 s)"
    assert caller.call("hangs", {"seconds": 0.01}) == ToolResult("slept 0.01 s", None)
    assert caller._workers["hangs"].starts == 2


def test_closure_tools_run_in_a_fork_and_a_dying_worker_is_raised():
    offset = 100

    def shifted(x: int) -> int:
        """x plus the offset, or the worker dies on x = -1.

        Args:
            x: a number
        """
        if x == -1:
            os._exit(3)
        return x + offset

    with ToolCaller([tool_from_function(shifted)], timeout_s=5.0) as caller:
        assert caller.call("shifted", {"x": 1}) == ToolResult("101", None)
        assert caller._workers["shifted"]._kind.__name__ == "_ForkedWorker"
        died = caller.call("shifted", {"x": -1})
        assert died.error == "raised" and "died mid-call (exit code 3)" in died.text, died.text
        assert caller.call("shifted", {"x": 2}) == ToolResult("102", None)
    with pytest.raises(RuntimeError, match="called after close"):
        caller.call("shifted", {"x": 1})


def test_many_threads_at_once(caller):
    results, problems = {}, []

    def trajectory(i: int) -> None:
        try:
            for j in range(5):
                x = 10 * i + j
                results[("square", x)] = caller.call("square", {"x": x})
                results[("add", x)] = caller.call("add", {"a": x, "b": 1})
                results[("maybe", x)] = caller.call("maybe", {"x": x})
        except Exception as exc:  # noqa: BLE001 - reported below
            problems.append(exc)

    threads = [threading.Thread(target=trajectory, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not problems and len(results) == 8 * 5 * 3
    for (name, x), got in results.items():
        want = {"square": json.dumps({"x": x, "square": x * x}), "add": str(x + 1), "maybe": f"x={x}"}[name]
        assert got == ToolResult(want, None), (name, x, got)
    assert caller._workers["square"].starts == 1 and caller._workers["maybe"].starts == 1


def test_a_worker_outlives_the_thread_that_started_it(caller):
    # Linux's parent-death signal follows the starting *thread*: a worker started by a rollout thread that then
    # returned was SIGKILLed (the next call died mid-call or restarted it). Workers start on a lasting thread.
    started = threading.Thread(target=caller.call, args=("square", {"x": 2}))
    started.start()
    started.join(60)
    time.sleep(0.3)  # the kernel's signal would have landed by now
    worker = caller._workers["square"]
    assert worker._worker.alive() and caller.call("square", {"x": 3}).error is None and worker.starts == 1


def test_caller_refuses_duplicate_tools_and_no_limit():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolCaller([get_tool("add"), get_tool("add")], timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ToolCaller([get_tool("add")], timeout_s=0)


# ------------------------------------------------------------------------------------------ Hermes
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_parse_one_call_with_text_before():
    assert parse_tool_calls(CALL) == ParsedTurn("", [ToolCallRequest("add", {"a": 1, "b": 2})], [])
    assert parse_tool_calls("I will add them.\n\n" + CALL) == \
        ParsedTurn("I will add them.", [ToolCallRequest("add", {"a": 1, "b": 2})], [])
    assert parse_tool_calls("  no calls here ") == ParsedTurn("no calls here", [], [])


def test_parse_several_blocks_in_order():
    text = ('First.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>  \n {"name": "square", "arguments": {"x": 3}} \n\t</tool_call>tail')
    got = parse_tool_calls(text)
    assert got.calls == [ToolCallRequest("add", {"a": 1, "b": 2}), ToolCallRequest("square", {"x": 3})]
    assert got.content == "First.\n\ntail" and got.malformed == []


def test_arguments_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_tool_calls(text).calls == [ToolCallRequest("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("block, said", [
    ('<tool_call>{"name": "add", "arguments": {}}', "a <tool_call> without its </tool_call>: '{\"name\""),
    ('</tool_call>', "a </tool_call> without its <tool_call>"),
    ('<tool_call>{"name": "add", </tool_call>', "a tool call: not valid JSON ("),
    ('<tool_call></tool_call>', "a tool call: not valid JSON ("),
    ('<tool_call>[1, 2]</tool_call>', 'a tool call must be a JSON object with "name" and "arguments", got an array'),
    ('<tool_call>{"arguments": {}}</tool_call>', 'a tool call without a "name"'),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', 'a tool call\'s "name" must be a string, got a number'),
    ('<tool_call>{"name": " ", "arguments": {}}</tool_call>', 'a tool call with an empty "name"'),
    ('<tool_call>{"name": "add"}</tool_call>', 'the call of \'add\' has no "arguments"'),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     'the "arguments" of \'add\' must be a JSON object, got an array'),
    ('<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>',
     "the arguments of 'add': expected a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "the arguments of 'add': not valid JSON"),
    ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "nested deeper than 64 levels"),
    ('<tool_call>{"name": "add", "arguments": {"a": "' + "x" * MAX_CALL_BYTES + '"}}</tool_call>',
     f"a tool call longer than {MAX_CALL_BYTES} bytes"),
])
def test_malformed_blocks_are_reported_not_called(block, said):
    got = parse_tool_calls("before " + block + " after " + CALL)
    assert got.calls == [ToolCallRequest("add", {"a": 1, "b": 2})]  # an unclosed block ends at the next one
    assert len(got.malformed) == 1 and said in got.malformed[0], got.malformed
    assert len(got.malformed[0]) < 300  # the model's text is quoted, cut
    assert got.content.startswith("before")


def test_an_unclosed_block_before_a_good_one_keeps_the_good_one():
    got = parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}\n' + CALL)
    assert got.calls == [ToolCallRequest("add", {"a": 1, "b": 2})]
    assert got.malformed == ["a <tool_call> without its </tool_call>: '{\"name\": \"add\", \"arguments\": {}}'"]
    assert got.content == ""  # the broken call is not prose


@pytest.mark.parametrize("compact", [False, True])
def test_format_round_trips(compact):
    assert format_tool_call("add", {"a": 1, "b": 2}) == CALL
    assert format_tool_call("add", {"a": 1, "b": 2}, compact=True) == \
        '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    for name, arguments in [("add", {"a": 1, "b": 2}), ("search", {"query": "é ü 中文", "weights": [0.5, 1e-9]}),
                            ("echo", {}), ("echo", {"text": "a </tool_call> and <tool_call> inside\nnewline"})]:
        text = format_tool_call(name, arguments, compact=compact)
        assert ("\n" not in text) if compact else text.startswith("<tool_call>\n{")
        assert parse_tool_calls("say " + text + text) == \
            ParsedTurn("say", [ToolCallRequest(name, arguments)] * 2, [])
