"""The chat format of multi-turn rollouts (megagspo/agent/chat.py), on the tiny offline BPE tokenizer and the
builtin_tools tokenizer:

- the suffix method (prompt ids, each turn's sampled ids and end-of-turn token, the template's suffix after a fixed
  base conversation) gives transformers' own tokenization of the whole conversation, for 1-3 tool rounds, two
  calls in one turn, text before a call, tools and a system message;
- the exact-prefix check passes where the template keeps history, and fails closed, naming the turn and token,
  where it does not (Qwen3's non-thinking generation prompt; a template that drops earlier <think> blocks);
- the builtin_tools tokenizer keeps the built-in ids, encodes a compact Hermes call in 21 tokens, and its format
  renders the same first prompt as the built-in tokenizer.
"""

import shutil

import pytest

from megagspo.agent.chat import PREFIX_POLICY_OPTION, PrefixMismatch, chat_format
from megagspo.data import BuiltinTokenizer, load_tokenizer
from megagspo.tools.tiny_hf_model import CHAT_TEMPLATE_DROPS_THINKING, TinyHFSpec, build_tiny_hf_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def _call(a: int, b: int) -> str:
    """A Hermes tool call as Qwen3 samples it."""
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _tool(text):
    return {"role": "tool", "content": text}


Q = _user("What is 18 + 25 + 7 + 1?")
CONVERSATIONS = {
    "one_round": [Q, _assistant(_call(18, 25)), _tool("43"), _assistant("The answer is 43.")],
    "two_rounds": [Q, _assistant("<think>\nAdd in steps.\n</think>\n\n" + _call(18, 25)), _tool("43"),
                   _assistant(_call(43, 7)), _tool("50"), _assistant("#### 50")],
    "three_rounds_ending_on_a_tool": [Q, _assistant(_call(18, 25)), _tool("43"), _assistant(_call(43, 7)),
                                      _tool("50"), _assistant(_call(50, 1)), _tool("51")],
    "two_calls_in_one_turn": [Q, _assistant(_call(18, 25) + "\n" + _call(7, 1)), _tool("43"), _tool("8"),
                              _assistant("43 + 8 = 51")],
    "text_before_a_call": [Q, _assistant("Let me add.\n" + _call(18, 25)), _tool("43"), _assistant("43")],
    "system_message": [{"role": "system", "content": "Be brief."}, Q, _assistant(_call(18, 25)),
                       _tool("error: bad arguments"), _user("Try again."), _assistant("43")],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny tokenizer with each chat template (no model weights), and one with a Qwen3-like quirk."""
    root = tmp_path_factory.mktemp("agent_chat")
    made = {name: build_tiny_hf_tokenizer(str(root / name), TinyHFSpec(chat_template=name))
            for name in ("keeps_history", "drops_thinking")}
    # Qwen3's template writes an empty <think> block into a final assistant turn after the last real query
    quirk = root / "final_turn_think"
    shutil.copytree(made["keeps_history"], quirk)
    turn = "{{- '<|im_start|>assistant\\n' + content }}"
    assert turn in CHAT_TEMPLATE_DROPS_THINKING
    (quirk / "chat_template.jinja").write_text(CHAT_TEMPLATE_DROPS_THINKING.replace(turn, (
        "{{- '<|im_start|>assistant\\n' }}{%- if loop.last and loop.index0 > ns.last_query_index and "
        "'</think>' not in content %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- content }}")))
    made["final_turn_think"] = str(quirk)
    return made


def _trajectory(fmt, conversation, check=True):
    """The ids the suffix method gives (prompt, then each assistant turn's ids + end-of-turn token, then the suffix
    of the messages after it), checking the prefix before each turn is generated."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    ids, at, turn = fmt.prompt_ids(conversation[:first]), first, 0
    while at < len(conversation):
        ids += fmt.encode(conversation[at]["content"]) + [fmt.end_of_turn_id]
        turn, end = turn + 1, at + 1
        while end < len(conversation) and conversation[end]["role"] != "assistant":
            end += 1
        if end > at + 1:
            ids += fmt.suffix_ids(conversation[at + 1:end])
            if check:
                fmt.check_prefix(conversation[:end], ids, turn)
        at = end
    return ids


def _transformers_ids(tok, conversation, **kwargs):
    ends_on_tool = conversation[-1]["role"] != "assistant"
    out = tok.tok.apply_chat_template(conversation, tools=TOOLS, tokenize=True, add_generation_prompt=ends_on_tool,
                                      **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}], ids=["thinking_unset", "thinking_true"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_suffix_method_equals_the_template_tokenization(folders, name, kwargs):
    tok = load_tokenizer(folders["keeps_history"], "chat", kwargs, tools=TOOLS)
    fmt = chat_format(tok)
    conversation = CONVERSATIONS[name]
    ours, theirs = _trajectory(fmt, conversation), _transformers_ids(tok, conversation, **kwargs)
    assert ours == theirs[:len(ours)]
    # a trajectory ends on the end-of-turn token; the template then writes the boundary "\n"
    assert len(theirs) - len(ours) == (1 if conversation[-1]["role"] == "assistant" else 0)
    assert "# Tools" in fmt.decode(ours) and fmt.prompt_ids(conversation[:2]) == tok.prompt_ids(conversation[:2])


def test_non_thinking_generation_prompt_fails_the_prefix_check(folders):
    """enable_thinking=false pre-fills an empty think block the history does not keep: Qwen3's known break."""
    tok = load_tokenizer(folders["keeps_history"], "chat", {"enable_thinking": False}, tools=TOOLS)
    fmt = chat_format(tok)
    prompt = fmt.prompt_ids([Q])
    with pytest.raises(PrefixMismatch) as caught:
        _trajectory(fmt, CONVERSATIONS["one_round"])
    think_at = len(prompt) - len(fmt.encode("<think>\n\n</think>\n\n"))
    assert caught.value.turn == 1 and caught.value.token_index == think_at
    assert f"token {think_at} (id {prompt[think_at]}, '<think>')" in str(caught.value)
    assert PREFIX_POLICY_OPTION in str(caught.value)


def test_a_template_dropping_earlier_thinking_fails_the_prefix_check(folders):
    thought = "<think>\nAdd the tens, then the ones.\n</think>\n\n"
    conversation = [Q, _assistant(thought + _call(18, 25)), _tool("43"), _assistant(thought + "43"),
                    _user("And 43 + 1?")]
    keeps = chat_format(load_tokenizer(folders["keeps_history"], tools=TOOLS))
    _trajectory(keeps, conversation)  # passes: history renders as sampled
    drops = chat_format(load_tokenizer(folders["drops_thinking"], tools=TOOLS))
    _trajectory(drops, conversation[:3])  # tool results follow: the thinking is still after the last query
    ids = _trajectory(drops, conversation, check=False)
    with pytest.raises(PrefixMismatch, match=r"turn 2: .*token \d+ \(id \d+, '<think>'\)") as caught:
        drops.check_prefix(conversation, ids, turn=2)
    assert caught.value.turn == 2 and caught.value.token_index == len(drops.prompt_ids([Q]))
    assert ids[caught.value.token_index] == drops.encode("<think>")[0]


def test_the_boundary_newline_belongs_to_the_suffix(folders):
    fmt = chat_format(load_tokenizer(folders["keeps_history"]))
    assert fmt.decode([fmt.end_of_turn_id]) == "<|im_end|>"
    suffix = fmt.suffix_ids([_tool("43")])
    assert suffix[0] == fmt.encode("\n")[0]
    assert fmt.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n43\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="needs the messages"):
        fmt.suffix_ids([])


def test_a_template_that_rewrites_a_final_turn_still_gets_its_suffix(folders):
    """A base conversation ending on an assistant turn is re-rendered once messages follow it under Qwen3's
    template; the format falls back to a base without a real query, and the suffix is the same."""
    quirk = chat_format(load_tokenizer(folders["final_turn_think"], tools=TOOLS))
    keeps = chat_format(load_tokenizer(folders["keeps_history"], tools=TOOLS))
    assert quirk.base != keeps.base
    for follow in ([_tool("43")], [_tool("1"), _tool("2")], [_user("next")]):
        assert quirk.suffix_ids(follow) == keeps.suffix_ids(follow)


def test_tiny_template_renders_qwen3_layout(folders):
    tok = load_tokenizer(folders["keeps_history"])
    render = tok.tok.apply_chat_template
    # plain chats render as before the tool layout
    assert render([_user("hi")], tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render([_user("hi")], tokenize=False, add_generation_prompt=True, enable_thinking=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # structured tool_calls render as the raw text the model samples
    structured = {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 18, "b": 25}}},
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 7, "b": 1}'}}]}
    raw = _assistant("Let me add.\n" + _call(18, 25) + "\n" + _call(7, 1))
    assert render([Q, structured], tokenize=False) == render([Q, raw], tokenize=False)
    bare = {"role": "assistant", "content": None, "tool_calls": structured["tool_calls"][:1]}
    assert render([Q, bare], tokenize=False) == render([Q, _assistant(_call(18, 25))], tokenize=False)
    system = render([{"role": "system", "content": "Be brief."}, Q], tools=TOOLS, tokenize=False)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert '\n<tools>\n{"type": "function", "function": {"name": "add", ' in system
    assert system.endswith('"arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\n'
                           + Q["content"] + "<|im_end|>\n")
    # the tags are added tokens after the BPE's 300: the model's vocabulary stays 320
    tags = tok.tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                          "<think>", "</think>"])
    assert tags == list(range(300, 306)) and len(tok.tok) == 306 and -(-len(tok.tok) // 64) * 64 == 320


def test_hf_tools_need_a_chat_template(folders):
    with pytest.raises(ValueError, match="tools are given but tokenizer .* formats prompts as plain text"):
        load_tokenizer(folders["keeps_history"], "plain", tools=TOOLS)
    with pytest.raises(ValueError, match="plain text"):
        chat_format(load_tokenizer(folders["keeps_history"], "plain"))
    with pytest.raises(ValueError, match="differ from the tokenizer's own"):
        chat_format(load_tokenizer(folders["keeps_history"], tools=TOOLS), tools=TOOLS + TOOLS)


def test_builtin_tools_tokenizer():
    plain, tools = BuiltinTokenizer(), load_tokenizer("builtin_tools")
    assert plain.vocab_size == 20 and tools.itos[:20] == plain.itos and tools.vocab_size > 20
    compact = '<tool_call>{"name":"add","arguments":{"a":18,"b":25}}</tool_call>'
    assert len(tools.encode(compact)) == 21
    text = "<bos>07+42=" + compact + "<eos><tool_response>error: Bad input!\n</tool_response>49<eos><pad>"
    ids = tools.encode(text)
    assert tools.decode_with_specials(ids) == text
    assert tools.decode(ids) == "07+42=" + compact  # decode stops at eos and skips bos, as before
    assert ids[0] == tools.bos_id and tools.encode("<eos>") == [tools.eos_id]
    with pytest.raises(ValueError, match="cannot encode character 'é' .* printable ASCII"):
        tools.encode("café")
    with pytest.raises(ValueError, match="cannot encode character '<'"):
        plain.encode("<bos>")  # the plain built-in tokenizer parses no specials
    with pytest.raises(ValueError, match="builtin_tools"):
        load_tokenizer("builtin", tools=TOOLS)
    with pytest.raises(ValueError, match="builtin_tools"):
        chat_format(plain)


def test_builtin_tools_chat_format():
    tok = load_tokenizer("builtin_tools")
    fmt = chat_format(tok, TOOLS)  # tools are not rendered: the tiny model learns its tool from demonstrations
    assert fmt.end_of_turn_id == tok.eos_id
    assert fmt.prompt_ids([_user("07+42=")]) == BuiltinTokenizer().prompt_ids("07+42=") == fmt.prompt_ids("07+42=")
    assert fmt.suffix_ids([_tool("43")]) == tok.encode("<tool_response>43</tool_response>")
    call = '<tool_call>{"name":"add","arguments":{"a":7,"b":42}}</tool_call>'
    conversation = [_user("07+42="), _assistant(call), _tool("49"), _assistant("49")]
    ids = _trajectory(fmt, conversation)
    assert fmt.decode(ids) == "<bos>07+42=" + call + "<eos><tool_response>49</tool_response>49<eos>"
    tampered = list(ids)
    at = len(fmt.prompt_ids("07+42=")) + 1
    tampered[at] = tok.encode("x")[0]
    upto = len(ids) - len(tok.encode("49<eos>"))  # the ids before the last turn: its generation prompt ends them
    fmt.check_prefix(conversation[:3], ids[:upto], turn=1)
    with pytest.raises(PrefixMismatch, match=rf"turn 1: .*token {at} \(id {tampered[at]}, 'x'\)") as caught:
        fmt.check_prefix(conversation[:3], tampered[:upto], turn=1)
    assert caught.value.token_index == at
    with pytest.raises(PrefixMismatch, match="the end of the tokens"):
        fmt.check_prefix(conversation[:3], ids[:5], turn=1)
    with pytest.raises(ValueError, match="no system role"):
        fmt.prompt_ids([{"role": "system", "content": "x"}, _user("1+1=")])
