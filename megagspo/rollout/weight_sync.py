"""Full (TP=EP=1) Megatron GPTModel state dict -> Hugging Face Qwen3MoeForCausalLM state dict, in memory:
what the embedded engine loads after every update. The layout mapping lives in one place,
`moe.hf_checkpoint` (the same table that imports and exports HF checkpoints); this only adapts it to
`Qwen3MoeForCausalLM.load_state_dict`, which wants `lm_head.weight` even when it is tied to the embedding.
"""

from __future__ import annotations

from typing import Dict

import torch


def megatron_to_hf_state_dict(full: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    from moe.hf_checkpoint import FUSED, hf_state_dict_from_megatron

    out = hf_state_dict_from_megatron({name: t.detach() for name, t in full.items()}, arch, expert_layout=FUSED)
    if arch.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
