"""The rollout-engine interface and registry.

Legend: N = prompts, G = samples per prompt, R = N*G responses (prompt-major: the G samples of prompt i
are rows i*G .. i*G+G-1), L = max response tokens, Ly = layers, K = experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


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
    """generate(prompts, n, sampling) -> RolloutOutput; update_weights(full Megatron state dict)."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> RolloutOutput:
        raise NotImplementedError

    def update_weights(self, megatron_state: Dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


_ENGINES: Dict[str, type] = {}


def register_engine(name: str):
    def deco(cls):
        _ENGINES[name] = cls
        return cls

    return deco


def available_engines() -> list:
    from . import hf_engine  # noqa: F401  (registers "hf")

    return sorted(set(_ENGINES) | {"sglang"})


def get_engine_class(name: str) -> type:
    if name == "sglang" and name not in _ENGINES:
        try:
            from . import sglang_engine  # noqa: F401  (registers "sglang"; the sglang package itself is optional)
        except ImportError:
            pass
    if name == "sglang" and name not in _ENGINES:
        try:  # registers "sglang"; needs only the stdlib HTTP client (launching servers needs sglang itself)
            from . import sglang_engine  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"rollout.engine = 'sglang' could not be loaded ({exc}); it needs running SGLang "
                               "servers or `pip install sglang` on a GPU host. Use rollout.engine = 'hf' on CPU.") from exc
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; valid names: {', '.join(available_engines())}") from None
