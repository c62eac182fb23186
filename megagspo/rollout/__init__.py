"""Rollout engines: `generate(prompts, n, sampling) -> RolloutOutput` (tokens, log-probs, routes).

Registered engines: "hf" (transformers Qwen3MoeForCausalLM with KV cache, the embedded default) and
"sglang" (SGLang servers on GPU hosts: the client needs only the stdlib; launching servers needs sglang).
"""

from .base import (RolloutEngine, RolloutOutput, SamplingParams, WeightSwitch, available_engines, get_engine_class,
                   register_engine)
from .hf_engine import HFRolloutEngine, hf_config_for
from .sglang import SGLangEngine
from .weight_sync import megatron_to_hf_state_dict

__all__ = ["HFRolloutEngine", "RolloutEngine", "SGLangEngine", "RolloutOutput", "SamplingParams", "WeightSwitch",
           "available_engines",
           "get_engine_class", "hf_config_for", "megatron_to_hf_state_dict", "register_engine"]
