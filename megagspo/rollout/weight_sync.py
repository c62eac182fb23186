"""Full (TP=EP=1) Megatron GPTModel state dict -> Hugging Face Qwen3MoeForCausalLM state dict, in memory.

TODO(moe/hf_checkpoint.py): switch to the moe library's Megatron->HF export once it lands; this minimal
converter covers exactly the Qwen3-MoE layout the trainer builds (all layers MoE or dense SwiGLU, qk-norm,
untied or tied embeddings).

Layouts (Megatron -> HF 5.x):
  linear_qkv.weight [(q_per_group + 2) * D * n_groups, H]: per KV group g, [q heads of g; k_g; v_g]
      -> q_proj [n_heads*D, H], k_proj / v_proj [n_groups*D, H]
  experts.local_experts.e.linear_fc1.weight [2I, H] = [gate; up] -> mlp.experts.gate_up_proj[e] [2I, H]
  experts.local_experts.e.linear_fc2.weight [H, I]               -> mlp.experts.down_proj[e]    [H, I]
  router.weight [E, H] -> mlp.gate.weight;  pre_mlp_layernorm -> post_attention_layernorm
"""

from __future__ import annotations

from typing import Dict

import torch


def megatron_to_hf_state_dict(full: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    n_heads, n_groups, head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    q_per_group = n_heads // n_groups
    hidden = arch.hidden_size
    out: Dict[str, torch.Tensor] = {}
    used = set()

    def take(name):
        used.add(name)
        return full[name].detach()

    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if "output_layer.weight" in full:
        out["lm_head.weight"] = take("output_layer.weight")
    else:  # tied embeddings
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    for i in range(arch.num_hidden_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
        qkv = take(m + "self_attention.linear_qkv.weight").reshape(n_groups, (q_per_group + 2) * head_dim, hidden)
        q, k, v = torch.split(qkv, [q_per_group * head_dim, head_dim, head_dim], dim=1)
        out[h + "self_attn.q_proj.weight"] = q.reshape(n_heads * head_dim, hidden)
        out[h + "self_attn.k_proj.weight"] = k.reshape(n_groups * head_dim, hidden)
        out[h + "self_attn.v_proj.weight"] = v.reshape(n_groups * head_dim, hidden)
        out[h + "self_attn.o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        out[h + "self_attn.q_norm.weight"] = take(m + "self_attention.q_layernorm.weight")
        out[h + "self_attn.k_norm.weight"] = take(m + "self_attention.k_layernorm.weight")
        if arch.moe_layer_pattern[i]:
            out[h + "mlp.gate.weight"] = take(m + "mlp.router.weight")
            fc1 = [take(f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight") for e in range(arch.num_experts)]
            fc2 = [take(f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight") for e in range(arch.num_experts)]
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
            out[h + "mlp.experts.down_proj"] = torch.stack(fc2)
        else:
            fc1 = take(m + "mlp.linear_fc1.weight")
            gate, up = torch.chunk(fc1, 2, dim=0)
            out[h + "mlp.gate_proj.weight"] = gate
            out[h + "mlp.up_proj.weight"] = up
            out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    unused = sorted(set(full) - used)
    if unused:
        raise KeyError(f"Megatron tensors with no HF counterpart in the converter: {unused[:6]}")
    return out
