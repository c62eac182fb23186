"""Agents: `run(sample, engine, sampling) -> Trajectory` hooks, registered by name as rewards are.

`Episode` is what every agent builds a trajectory with: the conversation (messages) and the trajectory's ids side
by side. `assistant_turn` samples a turn after the ids so far (token in, token out); `add_messages` appends tool or
user messages as the chat template's suffix (loss mask 0, the template's boundary tokens included) and runs the
exact-prefix check; the budgets (turns, total tokens, tool-response tokens) are enforced here, once.

Built in:
    tool_loop     the standard tool loop: the model's Hermes tool calls are run (time-limited) and their results
                  appended until it answers without a call; a malformed call, an unknown tool, a tool that raises
                  and one that runs past its limit each become tool text the model reads, counted by kind
    environment   a registered stateful environment: reset(example) -> first messages, step(assistant text) ->
                  EnvStep(messages, done, reward)

A user agent: `@register_agent("mine")` on a factory `(AgentContext) -> object with run(sample, engine, sampling)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol

from megagspo.rollout.base import SamplingParams

from .chat import ChatFormat, PrefixMismatch
from .hermes import parse_tool_calls
from .tools import ToolCaller
from .trajectory import Trajectory

if TYPE_CHECKING:  # the config describes a run; the agent package never needs it loaded (megagspo.data imports
    # the agent's Hermes writer while megagspo.config is still importing megagspo.data)
    from megagspo.config import AgentConfig


@dataclass(frozen=True)
class AgentSample:
    """One sample of a batch: its example (prompt, answer, prompt_ids) and its row in the batch."""

    example: object
    index: int

    @property
    def messages(self) -> List[dict]:
        """The example's prompt as chat messages (a string prompt is one user message)."""
        prompt = self.example.prompt
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


@dataclass
class AgentContext:
    """What an agent factory is given: the run's rollout.agent config, the chat format and the tool caller."""

    config: AgentConfig
    chat: ChatFormat
    tools: Optional[ToolCaller]

    def episode(self, messages: List[dict]) -> "Episode":
        return Episode(self, messages)


class Episode:
    """One trajectory in the making (see the module docstring)."""

    def __init__(self, context: AgentContext, messages: List[dict]) -> None:
        self.context, self.chat, self.config = context, context.chat, context.config
        self.conversation = [dict(m) for m in messages]
        self.trajectory = Trajectory(prompt_ids=list(self.chat.prompt_ids(self.conversation)))
        self.can_continue = True   # the last turn ended with the template's end-of-turn token

    def assistant_turn(self, engine, sampling: SamplingParams) -> Optional[str]:
        """Sample the next assistant turn; -> its text (without the end-of-turn token), or None when the length
        budget cut the trajectory (status truncated)."""
        t = self.trajectory
        room = self.config.max_total_tokens - len(t.ids)
        if room < 1:
            t.status = "truncated"
            return None
        turn = engine.generate(t.prompt_ids + t.ids,
                               dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room)))
        t.add_sampled(turn)
        closes = turn.ended and turn.ids[-1] == self.chat.end_of_turn_id
        text = self.chat.decode(turn.ids[:-1] if closes else turn.ids)
        self.conversation.append({"role": "assistant", "content": text})
        if not turn.ended:  # cut at its token budget: never finished
            t.status = "truncated"
            return None
        self.can_continue = closes  # another stop token (an end-of-text) ends the conversation
        return text

    def add_messages(self, messages: List[dict]) -> bool:
        """Tool / user messages after the last assistant turn, as the template's suffix (mask 0), then the prefix
        check. False when they and one more sampled token do not fit max_total_tokens (status truncated)."""
        t = self.trajectory
        messages = [self._cut_tool_response(m) if m.get("role") == "tool" else dict(m) for m in messages]
        suffix = self.chat.suffix_ids(messages)
        if len(t.ids) + len(suffix) + 1 > self.config.max_total_tokens:
            t.status = "truncated"
            return False
        t.add_context(suffix)
        self.conversation.extend(messages)
        try:
            self.chat.check_prefix(self.conversation, t.prompt_ids + t.ids, turn=t.turns + 1)
        except PrefixMismatch:
            if self.config.prefix_policy == "fail":
                raise
            t.prefix_rewrites += 1
        return True

    def _cut_tool_response(self, message: dict) -> dict:
        """A tool response longer than max_tool_response_tokens, cut on rollout.agent.tool_response_truncation's
        side (counted)."""
        limit = self.config.max_tool_response_tokens
        ids = self.chat.encode(message["content"])
        if len(ids) <= limit:
            return dict(message)
        self.trajectory.tool_truncations += 1
        kept = ids[:limit] if self.config.tool_response_truncation == "right" else ids[-limit:]
        return {**message, "content": self.chat.decode(kept)}

    def finish(self, status: Optional[str] = None, final_text: str = "", reward: Optional[float] = None) -> Trajectory:
        t = self.trajectory
        if t.status != "truncated" and status is not None:
            t.status = status
        t.final_text, t.reward = final_text, reward
        return t


class ToolAgent:
    """The built-in tool loop (see the module docstring)."""

    def __init__(self, context: AgentContext) -> None:
        if context.tools is None:
            raise ValueError("the tool_loop agent needs tools (rollout.agent.tools)")
        self.context = context

    def run(self, sample: AgentSample, engine, sampling: SamplingParams) -> Trajectory:
        episode = self.context.episode(sample.messages)
        t = episode.trajectory
        while True:
            text = episode.assistant_turn(engine, sampling)
            if text is None:
                return episode.finish()
            parsed = parse_tool_calls(text)
            if not episode.can_continue or not (parsed.calls or parsed.malformed):
                return episode.finish("done", parsed.content)
            if t.turns >= self.context.config.max_turns:
                return episode.finish("max_turns", parsed.content)
            if not episode.add_messages(self._results(t, parsed)):
                return episode.finish()

    def _results(self, t: Trajectory, parsed) -> List[dict]:
        """One tool message per call, malformed ones included (the model reads what went wrong)."""
        texts = []
        for problem in parsed.malformed:
            t.count_error("malformed")
            texts.append(f"error: malformed tool call: {problem}")
        for call in parsed.calls:
            t.tool_calls += 1
            result = self.context.tools.call(call.name, call.arguments)
            if result.error is not None:
                t.count_error(result.error)
            texts.append(result.text)
        return [{"role": "tool", "content": text} for text in texts]


@dataclass
class EnvStep:
    """What an environment answers to an assistant turn."""

    messages: List[dict] = field(default_factory=list)   # tool or user messages the model reads next
    done: bool = False
    reward: Optional[float] = None                        # the trajectory's reward (None: the run's verifier)


class Environment(Protocol):
    def reset(self, example) -> Optional[List[dict]]:
        """The first messages of a new episode (None: the example's prompt)."""
        ...

    def step(self, assistant_text: str) -> EnvStep:
        ...


class EnvironmentAgent:
    """A stateful environment, one instance per trajectory (`factory()`)."""

    def __init__(self, context: AgentContext, factory: Callable[[], Environment]) -> None:
        self.context, self.factory = context, factory

    def run(self, sample: AgentSample, engine, sampling: SamplingParams) -> Trajectory:
        env = self.factory()
        episode = self.context.episode(env.reset(sample.example) or sample.messages)
        while True:
            text = episode.assistant_turn(engine, sampling)
            if text is None:
                return episode.finish()
            step = env.step(text)
            if step.done or not episode.can_continue:
                return episode.finish("done", text, step.reward)
            if episode.trajectory.turns >= self.context.config.max_turns:
                return episode.finish("max_turns", text, step.reward)
            if not episode.add_messages(step.messages):
                return episode.finish()


_AGENTS: Dict[str, Callable[[AgentContext], object]] = {}
_ENVIRONMENTS: Dict[str, Callable[[], Environment]] = {}


def _registrar(table: dict, kind: str, name: str):
    def deco(factory):
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = factory
        return factory

    return deco


def register_agent(name: str):
    """Register an agent factory `(AgentContext) -> object with run(sample, engine, sampling) -> Trajectory`."""
    return _registrar(_AGENTS, "agent", name)


def register_environment(name: str):
    """Register an environment class (or any factory of Environment objects), used by rollout.agent.name =
    environment with rollout.agent.environment = name."""
    return _registrar(_ENVIRONMENTS, "environment", name)


def available_agents() -> List[str]:
    return sorted(_AGENTS)


def available_environments() -> List[str]:
    return sorted(_ENVIRONMENTS)


def build_agent(context: AgentContext):
    """The hook rollout.agent.name names, built for this run."""
    name = context.config.name
    if name not in _AGENTS:
        raise ValueError(f"unknown agent {name!r} (rollout.agent.name); valid names: {', '.join(available_agents())}")
    return _AGENTS[name](context)


register_agent("tool_loop")(ToolAgent)


@register_agent("environment")
def _environment_agent(context: AgentContext) -> EnvironmentAgent:
    name = context.config.environment
    if name not in _ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r} (rollout.agent.environment); valid names: "
                         f"{', '.join(available_environments()) or 'none registered'}")
    return EnvironmentAgent(context, _ENVIRONMENTS[name])
