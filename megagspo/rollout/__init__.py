"""Rollout engines: `generate(prompts, n, sampling) -> RolloutOutput` (tokens, log-probs, routes).

Registered engines: "hf" (transformers Qwen3MoeForCausalLM with KV cache, the embedded default) and
"sglang" (GPU hosts; not wired yet — selecting it fails with a clear message when the engine is built).
"""

from .base import RolloutEngine, RolloutOutput, SamplingParams, available_engines, get_engine_class, register_engine
from .hf_engine import HFRolloutEngine, hf_config_for
from .weight_sync import megatron_to_hf_state_dict

__all__ = ["HFRolloutEngine", "RolloutEngine", "RolloutOutput", "SamplingParams", "available_engines",
           "get_engine_class", "hf_config_for", "megatron_to_hf_state_dict", "register_engine"]
