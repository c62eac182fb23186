"""Shared helpers (no tests): tiny random Hugging Face Qwen3-MoE checkpoints for tests/test_hf_*.py, no downloads.

`make_hf_model(config_kwargs, seed)` builds a float32 `Qwen3MoeForCausalLM` with eager attention and eager
experts and re-draws every weight at a scale where activations, logits and router margins are O(1)
(HF's 0.02 init gives logits ~0.3 and near-uniform routing, which would test little).
`save_checkpoint(model, path, expert_layout, shard_kb)` writes it as transformers does (`save_pretrained`
writes the per-expert layout) or in the fused 5.x layout (`gate_up_proj [E, 2I, H]`), single file or sharded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6)


def hf_config(**overrides):
    from transformers import Qwen3MoeConfig

    kwargs = dict(BASE)
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


@torch.no_grad()
def make_hf_model(config_kwargs: dict, seed: int = 0, dtype=torch.float32):
    from transformers import Qwen3MoeForCausalLM

    config = hf_config(**config_kwargs)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if param.dim() == 1:  # RMSNorm gains
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        elif name.endswith("embed_tokens.weight"):
            param.copy_(torch.randn(param.shape, generator=generator))
        else:
            std = (3.0 if name.endswith("mlp.gate.weight") else 1.0) / math.sqrt(param.shape[-1])
            param.copy_(std * torch.randn(param.shape, generator=generator))
    return model.to(dtype)


def save_checkpoint(model, path: Path, expert_layout: str = "per_expert", shard_kb: int | None = None) -> Path:
    """Write `model` to `path`; per_expert via save_pretrained, fused as the module's own 5.x state dict."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if expert_layout == "per_expert":
        kwargs = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
        model.save_pretrained(path, **kwargs)
        return path
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.config.save_pretrained(path)
    if not shard_kb:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards, current, size = [], {}, 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_kb * 1000:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@torch.no_grad()
def hf_logits_and_routes(model, input_ids_BS: torch.Tensor):
    """Logits [B, S, V] and, per MoE layer index, the sorted top-k expert ids [B, S, k] (HF's router hook)."""
    routes: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(module, args, output, i=i):
            _, _, indices = output  # (router_logits, routing weights, top-k indices [B*S, k])
            routes[i] = indices.sort(dim=-1).values.reshape(*input_ids_BS.shape, -1)

        handles.append(gate.register_forward_hook(hook))
    try:
        logits = model(input_ids_BS).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, routes
