"""The rollout-engine interface and registry.

Legend (docs/architecture.md): B prompts, G samples per prompt, R = B*G responses (prompt-major: the G samples of
prompt i are rows i*G .. i*G+G-1), L max response tokens, P prompt + response positions, Ly MoE layers, K
experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    # sample with this generator instead of the process's global one (engines that draw from it: see
    # RolloutEngine.seeded_generator); a generation on a background thread needs its own stream
    generator: Optional[torch.Generator] = None


@dataclass
class RolloutOutput:
    """response_ids_RL is right-padded with pad_id; response_mask_RL marks generated tokens (eos included).
    logp_RL: the engine's log-prob of each generated token under the policy (temperature-1 log-softmax).
    routes_RPLyK: top-k expert ids per MoE layer of every position the engine FED to the model (prompt
    and response[:-1], P = prompt + L - 1 positions, -1 where not fed), i.e. the routes a training forward
    over the same input tokens would replay (R3); None unless recorded.
    version_RL: int64, the policy version whose weights sampled each generated token (and gave its logp_RL), 0
    past the response; set by a generation that switched weights part-way (partial rollouts, `WeightSwitch`),
    None when one version generated every token (the caller knows which).
    Multi-turn trajectories (megagspo.agent): the "response" is everything after the first prompt, sampled turns and
    the tool / user / template-boundary tokens between them; response_mask_RL marks all of it, loss_mask_RL only the
    sampled tokens (the only ones with a log-prob, a version and a loss), and agent_rows holds each row's turns,
    tool calls and errors, status, final text and the reward an environment gave (JSON-able)."""

    prompt_ids: list  # R lists of prompt token ids
    response_ids_RL: torch.Tensor
    response_mask_RL: torch.Tensor
    logp_RL: torch.Tensor
    routes_RPLyK: Optional[torch.Tensor] = None
    version_RL: Optional[torch.Tensor] = None
    loss_mask_RL: Optional[torch.Tensor] = None   # bool, multi-turn only: the sampled tokens (None: response_mask_RL)
    agent_rows: Optional[list] = None             # multi-turn only: one dict per row (megagspo.agent.trajectory)

    TENSORS: ClassVar[tuple] = ("response_ids_RL", "response_mask_RL", "logp_RL", "routes_RPLyK", "version_RL",
                                "loss_mask_RL")

    @property
    def sampled_RL(self) -> torch.Tensor:
        """bool: the tokens the engine sampled (the loss's tokens): loss_mask_RL, or every response token."""
        return (self.response_mask_RL if self.loss_mask_RL is None else self.loss_mask_RL).bool()

    def select_rows(self, rows: Sequence[int]) -> "RolloutOutput":
        """These rows, in this order."""
        index = torch.tensor(list(rows), dtype=torch.long)
        picked = {name: t[index] for name in self.TENSORS if (t := getattr(self, name)) is not None}
        return RolloutOutput(prompt_ids=[self.prompt_ids[r] for r in rows], **picked,
                             agent_rows=None if self.agent_rows is None else [self.agent_rows[r] for r in rows])

    @classmethod
    def concat(cls, outputs: Sequence["RolloutOutput"], pad_id: int) -> "RolloutOutput":
        """One output of several outputs' rows: responses right-padded to the longest (pad_id, masks False,
        log-prob 0, version 0), routes padded with -1 (not fed) to the most positions."""
        if len(outputs) == 1:
            return outputs[0]
        length = max(o.response_ids_RL.shape[1] for o in outputs)
        fills = {"response_ids_RL": pad_id, "response_mask_RL": False, "logp_RL": 0.0, "version_RL": 0,
                 "loss_mask_RL": False, "routes_RPLyK": -1}
        tensors = {}
        for name in cls.TENSORS:
            if getattr(outputs[0], name) is None:
                continue
            width = max(getattr(o, name).shape[1] for o in outputs) if name == "routes_RPLyK" else length
            tensors[name] = torch.cat([_pad_dim1(getattr(o, name), width, fills[name]) for o in outputs])
        rows = None if outputs[0].agent_rows is None else [row for o in outputs for row in o.agent_rows]
        return cls(prompt_ids=[p for o in outputs for p in o.prompt_ids], **tensors, agent_rows=rows)

    def state_dict(self) -> dict:
        """The checkpoint form, {"tensors": {name: Tensor}, "meta": JSON-able}: the tensors that exist, by their
        field names, and the prompts' ids. Log-probs are kept only where generated: padding may hold -inf, which a
        checkpoint's finiteness check refuses, and every reader masks it."""
        tensors = {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}
        tensors["logp_RL"] = self.logp_RL.masked_fill(~self.sampled_RL, 0.0)
        meta = {"prompt_ids": [list(p) for p in self.prompt_ids]}
        if self.agent_rows is not None:
            meta["agent_rows"] = [dict(row) for row in self.agent_rows]
        return {"tensors": tensors, "meta": meta}

    @classmethod
    def from_state(cls, tensors: Dict[str, torch.Tensor], meta: dict) -> "RolloutOutput":
        """The output `state_dict` wrote (missing optional tensors: None)."""
        return cls(prompt_ids=meta["prompt_ids"], **{name: tensors.get(name) for name in cls.TENSORS},
                   agent_rows=meta.get("agent_rows"))

    def versions_RL(self, version: int) -> torch.Tensor:
        """The sampling version of every token: version_RL, or `version` (the one the batch was started with)
        where the generation never switched."""
        if self.version_RL is not None:
            return self.version_RL
        return torch.full(self.response_ids_RL.shape, int(version), dtype=torch.long)


def _pad_dim1(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    shape = list(t.shape)
    shape[1] = width - t.shape[1]
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)


def response_texts(out: RolloutOutput, tokenizer) -> List[str]:
    """What a verifier reads of each row: the generated tokens decoded (the one place responses are decoded), or a
    trajectory's final answer (its last assistant turn outside tool calls)."""
    if out.agent_rows is not None:
        return [row["final_text"] for row in out.agent_rows]
    return [tokenizer.decode(r[m.bool()].tolist()) for r, m in zip(out.response_ids_RL, out.response_mask_RL)]


def trajectory_rewards(out: RolloutOutput, scores: List[float]) -> List[float]:
    """The verifier's scores with what a trajectory says of itself: an environment's own reward replaces the score,
    and a trajectory cut at its length budget (status "truncated") scores 0 (its answer was never finished)."""
    if out.agent_rows is None:
        return scores
    return [0.0 if row["status"] == "truncated" else (s if row.get("reward") is None else float(row["reward"]))
            for s, row in zip(scores, out.agent_rows)]


def rollout_function(generate: Callable[..., RolloutOutput], agent=None) -> Callable[..., RolloutOutput]:
    """The rollouts of examples on an engine's generate: single-turn, or `agent`'s multi-turn trajectories
    (megagspo.agent.AgentRollouts, passed in: this package never imports the agent)."""
    return single_turn(generate) if agent is None else agent.rollouts(generate)


def single_turn(generate: Callable[..., RolloutOutput]) -> Callable[..., RolloutOutput]:
    """An engine's generate(prompt ids, n, sampling, switch=) as a rollout function of examples (anything with
    `prompt_ids`): what the batch maker calls when no agent runs multi-turn trajectories."""
    def rollouts(examples, n: int, sampling: SamplingParams, switch: Optional[WeightSwitch] = None) -> RolloutOutput:
        prompt_ids = [ex.prompt_ids for ex in examples]
        # an engine without partial rollouts may not take `switch` at all
        return generate(prompt_ids, n, sampling) if switch is None else generate(prompt_ids, n, sampling, switch=switch)

    return rollouts


class WeightSwitch(Protocol):
    """Partial rollouts (`rollout.partial`): newer policy weights that may replace the engine's while a batch is
    being generated. The engine asks `pending()` between decoding steps (the embedded engine) or while requests
    are in flight (a server); when it says yes, the engine stops its unfinished responses where they are, calls
    `apply(engine)`, which loads the newest weights received into it, and continues them from their prefix
    (prompt + the tokens so far, re-read under the new weights), tagging every token with the `version` that
    sampled it (RolloutOutput.version_RL)."""

    version: int                       # the version of the engine's weights now

    def pending(self) -> bool:
        """Whether newer weights have arrived (cheap, never blocks; an engine may ask from a thread of its own, as
        SGLang's abort watcher does, while `apply` runs on the generating thread)."""
        ...

    def apply(self, engine: "RolloutEngine") -> int:
        """Load the newest weights received into `engine` (its update_weights_from_buckets); -> their version."""
        ...


class RolloutEngine:
    """generate(prompts, n, sampling) -> RolloutOutput. Weights come from the trainer as a stream of buckets,
    `update_weights_from_buckets`; `update_weights(full Megatron state dict)` is a stream of one bucket.
    `switch` (partial rollouts): newer weights may replace the engine's part-way (WeightSwitch); None: the whole
    batch is generated by the weights the engine holds (version_RL None)."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 switch: Optional[WeightSwitch] = None) -> RolloutOutput:
        raise NotImplementedError

    def update_weights(self, megatron_state: Dict[str, torch.Tensor]) -> None:
        """The whole full (TP=EP=PP=1) Megatron state at once: `update_weights_from_buckets([megatron_state])`."""
        self.update_weights_from_buckets([megatron_state])

    def update_weights_from_buckets(self, buckets: Iterable[Dict[str, torch.Tensor]]) -> None:
        """Load new weights from `buckets`: an iterable of dicts {full Megatron name: full tensor}, each a part of
        the full (TP=EP=PP=1) state, together every tensor once (moe.sharding.iter_full_state_buckets streams
        the trainer's model this way; a list of one whole state dict works too). The engine consumes each bucket
        before asking for the next, which may free it (copy what you keep). `buckets.receive` False (when the
        stream has it) means this rank gets empty buckets: it does not feed an engine, and only iterates.

        Every rank calls this with its stream and iterates it TO THE END, also when it fails part-way
        (`drain`): the stream's collectives line up across ranks, so stopping early leaves the others waiting."""
        raise NotImplementedError

    def seeded_generator(self, seed: int) -> Optional[torch.Generator]:
        """A generator for `SamplingParams.generator` when this engine samples in this process (from the global
        torch generator otherwise); None for an engine that samples elsewhere (a server), whose generation
        draws nothing from this process's random state."""
        return None

    def weights_needed(self, generates: bool) -> bool:
        """Whether this process's engine must receive the weights at a sync, given whether this process
        generates rollouts (the trainer's model-parallel rank 0 of each data-parallel rank): the stream gives
        the buckets to those ranks only. Default: the ranks that generate (an engine living in the process)."""
        return generates


def drain(buckets: Iterator) -> None:
    """Iterate what is left of a weight stream, dropping it: a rank that stops consuming (it does not receive,
    or its consumer failed) must still take part in the stream's collectives."""
    for bucket in buckets:
        del bucket


_ENGINES: Dict[str, type] = {}


def register_engine(name: str):
    def deco(cls):
        _ENGINES[name] = cls
        return cls

    return deco


def available_engines() -> list:
    """The registered engines' names (every engine module registers itself when `megagspo.rollout` loads)."""
    return sorted(_ENGINES)


def get_engine_class(name: str) -> type:
    """The engine registered as `name`. The package `megagspo.rollout` imports every engine module (each
    registers itself; the SGLang client needs only the stdlib, the sglang package is imported where a server
    is launched), so this module never imports its engines back."""
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; valid names: {', '.join(available_engines())}") from None
