"""The rollout-engine interface and registry.

Legend (docs/architecture.md): B prompts, G samples per prompt, R = B*G responses (prompt-major: the G samples of
prompt i are rows i*G .. i*G+G-1), L max response tokens, P prompt + response positions, Ly MoE layers, K
experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, Optional, Sequence

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
    over the same input tokens would replay (R3); None unless recorded."""

    prompt_ids: list  # R lists of prompt token ids
    response_ids_RL: torch.Tensor
    response_mask_RL: torch.Tensor
    logp_RL: torch.Tensor
    routes_RPLyK: Optional[torch.Tensor] = None


class RolloutEngine:
    """generate(prompts, n, sampling) -> RolloutOutput. Weights come from the trainer as a stream of buckets,
    `update_weights_from_buckets`; `update_weights(full Megatron state dict)` is a stream of one bucket."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> RolloutOutput:
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
