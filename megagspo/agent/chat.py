"""A tokenizer's chat format, for multi-turn rollouts that stay token in, token out.

Sampled ids are kept as they are; only the text between assistant turns (tool results, user messages and the
template's boundary tokens, such as Qwen's "\\n" after <|im_end|>) is tokenized, as the suffix the chat template
renders after a fixed base conversation. The exact-prefix check compares, as text, the template's rendering of the
conversation so far with the tokens the trajectory holds: a template that rewrites history (Qwen3's drops earlier
turns' <think> blocks) makes the next prompt no longer extend the sampled tokens, and the check fails closed.

Two formats: an HF tokenizer's chat template (jinja, with tools), and the builtin_tools tokenizer's (Python).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from megagspo.data.tokenizer import BuiltinTokenizer, HFTokenizer

# The switch a caller offers when the check fails (the caller implements the policy; this module only raises).
PREFIX_POLICY_OPTION = "rollout.agent.prefix_policy: keep"
_SHOWN = 40  # characters of the two texts shown where they differ

# Fixed base conversations the suffix is cut after (content never depends on a sample). The first that renders
# stably is used: Qwen3's template writes an empty <think> block into a final assistant turn that follows the
# last real query, so its base conversation renders differently once messages follow; behind a user message that
# is a bare <tool_response> block (no real query) the assistant turn renders the same either way.
_BASES = (
    ({"role": "user", "content": "base question"}, {"role": "assistant", "content": "base answer"}),
    ({"role": "user", "content": "<tool_response>\nbase\n</tool_response>"},
     {"role": "assistant", "content": "base answer"}),
)
# Messages that follow the base when a format checks, at construction, that a base renders stably.
_PROBES = ([{"role": "tool", "content": "probe"}], [{"role": "user", "content": "probe"}])


class PrefixMismatch(ValueError):
    """The chat template renders the conversation so far differently from the tokens the trajectory holds."""

    def __init__(self, message: str, turn: int, token_index: int) -> None:
        super().__init__(message)
        self.turn = turn
        self.token_index = token_index


class ChatFormat(ABC):
    """render / encode / decode of one tokenizer, and the suffix and prefix methods built on them.

    end_of_turn_id: the token that ends an assistant turn (the engine stops on it; it is part of the sampled ids).
    base: the fixed base conversation (user, assistant) the suffix is cut after, chosen at construction.
    """

    end_of_turn_id: int
    base: tuple

    def __init__(self, tools: list[dict] | None) -> None:
        self.tools = tools

    @abstractmethod
    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (the tools given at construction included)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens written in it parsed as those tokens."""

    @abstractmethod
    def decode(self, ids) -> str:
        """The text of `ids`, lossless: specials kept, nothing stops at an end token."""

    def prompt_ids(self, messages) -> list[int]:
        """The first prompt: the messages (a string is one user message) rendered with the generation prompt."""
        messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        return self.encode(self.render(messages, add_generation_prompt=True))

    def suffix_ids(self, messages: list[dict]) -> list[int]:
        """The ids that follow an assistant turn's end-of-turn token when `messages` (tool / user messages) are
        appended to the conversation, the boundary text after that token and the generation prompt included."""
        if not messages:
            raise ValueError("suffix_ids needs the messages that follow the assistant turn (got none)")
        full = self.render(list(self.base) + list(messages), add_generation_prompt=True)
        head = self._head
        if not full.startswith(head):
            at = _first_difference(head, full)
            raise ValueError(f"the chat template renders the base conversation differently once these messages "
                             f"follow it (at character {at}: {head[at:at + _SHOWN]!r} becomes "
                             f"{full[at:at + _SHOWN]!r}): the text after an assistant turn cannot be cut as a "
                             f"suffix; roles {[m.get('role') for m in messages]}")
        return self.encode(full[self._cut(head):])

    def check_prefix(self, conversation: list[dict], ids: list[int], turn: int) -> None:
        """Raise PrefixMismatch unless the template's rendering of `conversation` (generation prompt included) is
        the text of `ids` (the prompt and every turn's ids so far). Assistant messages hold their sampled text
        raw, without the end-of-turn token; compared as text, so BPE's re-encoding of history cannot differ."""
        rendered = self.render(list(conversation), add_generation_prompt=True)
        held = self.decode(ids)
        if rendered == held:
            return
        at = _first_difference(rendered, held)
        index = self._token_at(ids, at)
        token = (f"token {index} (id {int(ids[index])}, {self.decode([ids[index]])!r})" if index < len(ids)
                 else f"the end of the tokens (after token {len(ids) - 1})")
        # shown from the start of that token: the texts may differ inside it ("<think>" / "<tool_call>")
        start = min(at, len(self.decode(ids[:index]).rstrip("\ufffd")))
        raise PrefixMismatch(
            f"turn {turn}: the chat template re-renders the conversation so far differently from the tokens the "
            f"trajectory holds, first at {token}: the tokens hold {held[start:start + _SHOWN]!r} where the "
            f"template renders {rendered[start:start + _SHOWN]!r} (character {at}); the next prompt would not "
            f"extend the sampled tokens. Set {PREFIX_POLICY_OPTION} to train on the tokens as sampled (the "
            f"template's re-rendering of history differs)", turn, index)

    def _cut(self, head: str) -> int:
        """Where the base assistant's end-of-turn token ends in the base rendering: the suffix starts there."""
        answer = self.base[-1]["content"] + self.decode([self.end_of_turn_id])
        at = head.rfind(answer)
        if at < 0:
            raise ValueError(f"the chat template does not end the base assistant turn with its end-of-turn token "
                             f"{self.decode([self.end_of_turn_id])!r}: {head[-2 * _SHOWN:]!r}")
        return at + len(answer)

    def _choose_base(self) -> None:
        """The first base conversation that renders as the prefix of itself followed by each probe."""
        for base in _BASES:
            try:
                head = self.render(list(base), add_generation_prompt=False)
                if all(self.render(list(base) + probe, True).startswith(head) for probe in _PROBES):
                    self.base, self._head = base, head  # the base's rendering, the same for every suffix
                    return
            except ValueError:  # a template may refuse a base (e.g. one with no real query): try the next
                continue
        raise ValueError("the chat template renders an assistant turn differently once tool or user messages "
                         "follow it, for every base conversation tried: the text between turns cannot be cut as "
                         "a suffix of the template")

    def _token_at(self, ids: list[int], char_index: int) -> int:
        """The index of the token of `ids` whose text holds character `char_index` of decode(ids); len(ids)
        when the text is shorter. Binary search over decoded prefixes (a byte-level token may end mid-character:
        the replacement characters such a prefix ends with are not counted)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[:mid + 1]).rstrip("\ufffd")) > char_index:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _first_difference(a: str, b: str) -> int:
    """The first character index where the two texts differ (the shorter one's length when one extends the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class HFChatFormat(ChatFormat):
    """An HF tokenizer's chat template (with data.chat_template_kwargs and the tools)."""

    def __init__(self, tokenizer: HFTokenizer, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self.tokenizer = tokenizer
        self._choose_base()
        self.end_of_turn_id = self._end_of_turn()

    def _end_of_turn(self) -> int:
        """The first token after the base assistant's content: it must be one the engine stops on."""
        head = self._head
        answer = self.base[-1]["content"]
        ids = self.encode(head[head.rfind(answer) + len(answer):])
        if not ids or ids[0] not in self.tokenizer.eos_ids:
            found = f"{self.decode(ids[:1])!r}" if ids else "nothing"
            raise ValueError(f"the chat template ends an assistant turn with {found}, which is none of the "
                             f"tokenizer's end tokens {list(self.tokenizer.eos_ids)}: the engine would not stop "
                             "at the end of a turn")
        return ids[0]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt, self.tools)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode_with_specials(ids)


class BuiltinChatFormat(ChatFormat):
    """The builtin_tools tokenizer's format, in Python: a user message is its text (the conversation's first
    message after <bos>), an assistant message its text then <eos>, a tool message
    <tool_response>text</tool_response>; no system role, and an empty generation prompt. Tools are not rendered
    into the prompt: the tiny model learns its tool from demonstrations."""

    def __init__(self, tokenizer: BuiltinTokenizer, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self.tokenizer = tokenizer
        self.end_of_turn_id = tokenizer.eos_id
        self._choose_base()

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        parts = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role == "system":
                raise ValueError("the builtin_tools chat format has no system role (put the instruction in the "
                                 "first user message)")
            if not isinstance(content, str):
                raise ValueError(f"message {i} ({role}): the builtin_tools chat format needs string content, got "
                                 f"{type(content).__name__}")
            if message.get("tool_calls"):
                raise ValueError(f"message {i}: the builtin_tools chat format renders no structured tool_calls "
                                 "(give the assistant's sampled text, tool-call blocks included, as its content)")
            if role == "user":
                text = content
            elif role == "assistant":
                text = content + "<eos>"
            elif role == "tool":
                text = "<tool_response>" + content + "</tool_response>"
            else:
                raise ValueError(f"message {i}: unknown role {role!r} (the builtin_tools chat format has user, "
                                 "assistant and tool)")
            parts.append(("<bos>" if i == 0 else "") + text)
        return "".join(parts)  # the generation prompt is empty: the model answers right after the text

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode_with_specials(ids)


def chat_format(tokenizer, tools: list[dict] | None = None) -> ChatFormat:
    """The chat format of an HF tokenizer with the chat prompt format, or of the builtin_tools tokenizer.

    tools: the schemas the template renders (an HF tokenizer's own `tools` when None; given both, they must be
    the same, or the dataset's prompts and the agent's would differ)."""
    if isinstance(tokenizer, HFTokenizer):
        if tokenizer.prompt_format != "chat":
            raise ValueError(f"multi-turn rollouts need a chat template; tokenizer {tokenizer.path!r} formats "
                             "prompts as plain text (set data.prompt_format = 'chat' with a tokenizer that has one)")
        if tools is not None and tokenizer.tools is not None and tools != tokenizer.tools:
            raise ValueError("chat_format got tools that differ from the tokenizer's own: the dataset's prompts "
                             "and the agent's would render different tool blocks")
        return HFChatFormat(tokenizer, tools if tools is not None else tokenizer.tools)
    if isinstance(tokenizer, BuiltinTokenizer):
        if not tokenizer.tools:
            raise ValueError("multi-turn rollouts with the built-in tokenizer need its tool tokens: use "
                             "data.tokenizer=builtin_tools")
        return BuiltinChatFormat(tokenizer, tools)
    raise ValueError(f"no chat format for a {type(tokenizer).__name__}: multi-turn rollouts take an HF tokenizer "
                     "with a chat template or the builtin_tools tokenizer")
