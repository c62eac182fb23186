"""A batch of samples through an agent: G trajectories per example, one thread per trajectory, their turns batched
on the rollout engine (megagspo.agent.turns), the trajectories stacked into one RolloutOutput (prompt-major, as a
single-turn batch: row i*G+g is sample g of example i).

`AgentRollouts(...)(generate)` is a rollout function `(examples, n, sampling, switch=None) -> RolloutOutput`, what
the batch maker and the evaluator call; `generate` is the engine's (prompt ids, n, sampling, switch=). A failure is
never swallowed: a template that rewrites history (policy fail) raises PrefixMismatch naming the sample, turn and
token; any other exception of an agent names the agent and the sample.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, List, Optional

from megagspo.rollout.base import RolloutOutput, SamplingParams, WeightSwitch

from .chat import ChatFormat, PrefixMismatch, chat_format
from .hermes import parse_tool_calls
from .loop import AgentContext, AgentSample, build_agent
from .tools import ToolCaller, get_tool
from .trajectory import stack_trajectories
from .turns import SampleEngine, TurnBatcher

if TYPE_CHECKING:  # the config describes a run; the agent package never needs it loaded (megagspo.data imports
    # the agent's Hermes writer while megagspo.config is still importing megagspo.data)
    from megagspo.config import AgentConfig


class AgentFailed(RuntimeError):
    """An agent's run of one sample raised; the message names the agent and the sample."""


class AgentRollouts:
    """The run's agent (rollout.agent), its chat format and tools; call `rollouts(generate)` per engine."""

    def __init__(self, config: AgentConfig, tokenizer) -> None:
        self.config = config
        tools = [get_tool(name) for name in config.tools]
        self.chat: ChatFormat = chat_format(tokenizer, [t.schema() for t in tools] or None)
        self.tools = ToolCaller(tools, config.tool_timeout_s) if tools else None
        self.pad_id, self.eos_ids = tokenizer.pad_id, tuple(tokenizer.eos_ids)
        self.agent = build_agent(AgentContext(config, self.chat, self.tools))

    def demonstration(self, example) -> tuple:
        """A cold-start SFT demonstration as (ids after the prompt, loss mask): example.demo, a string (one answer
        turn) or a tuple of assistant turns; the tool calls of each turn but the last are run (as the agent would
        run them) and their responses follow as the template's suffix, at mask 0. Ids and mask are what a trajectory
        of these turns holds."""
        turns = (example.demo,) if isinstance(example.demo, str) else tuple(example.demo)
        ids, mask = [], []
        for k, text in enumerate(turns):
            sampled = self.chat.encode(text) + [self.chat.end_of_turn_id]
            ids.extend(sampled)
            mask.extend([True] * len(sampled))
            if k + 1 < len(turns):
                parsed = parse_tool_calls(text)
                if self.tools is None or not parsed.calls:
                    raise ValueError(f"demonstration {turns!r}: turn {k + 1} is followed by another turn but makes no "
                                     "tool call the run's tools could answer")
                results = [self.tools.call(c.name, c.arguments).text for c in parsed.calls]
                suffix = self.chat.suffix_ids([{"role": "tool", "content": r} for r in results])
                ids.extend(suffix)
                mask.extend([False] * len(suffix))
        return ids, mask

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    def rollouts(self, generate: Callable[..., RolloutOutput]) -> Callable[..., RolloutOutput]:
        def run(examples, n: int, sampling: SamplingParams, switch: Optional[WeightSwitch] = None) -> RolloutOutput:
            return self.run(generate, examples, n, sampling, switch)

        return run

    def run(self, generate: Callable[..., RolloutOutput], examples: list, n: int, sampling: SamplingParams,
            switch: Optional[WeightSwitch] = None) -> RolloutOutput:
        samples = [AgentSample(ex, i * n + g) for i, ex in enumerate(examples) for g in range(n)]
        batcher = TurnBatcher(generate, len(samples), self.eos_ids, switch)
        trajectories: List = [None] * len(samples)
        errors: dict = {}

        def work(sample: AgentSample) -> None:
            try:
                trajectory = self.agent.run(sample, SampleEngine(batcher, sample.index), sampling)
                trajectory.check(f"agent {self.config.name!r}, sample {sample.index}")
                trajectories[sample.index] = trajectory
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after every thread has ended
                errors[sample.index] = exc
            finally:
                batcher.finished()

        threads = [threading.Thread(target=work, args=(s,), name=f"agent-sample-{s.index}", daemon=True)
                   for s in samples]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            first = min(errors)
            exc = errors[first]
            if isinstance(exc, PrefixMismatch):
                raise PrefixMismatch(f"sample {first}: {exc}", turn=exc.turn, token_index=exc.token_index) from None
            raise AgentFailed(f"agent {self.config.name!r} failed on sample {first} of {len(samples)} "
                              f"({len(errors)} failed): {type(exc).__name__}: {exc}") from exc
        return stack_trajectories(trajectories, self.pad_id)
