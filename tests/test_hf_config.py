"""HF `config.json` / YAML <-> Qwen3MoeArchitecture: every key classified, unknown keys and unsupported values
raise naming the key, and the inverse writes a config transformers rebuilds the same architecture from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe.architecture import Qwen3MoeArchitecture
from moe.hf_config import HfConfigError, architecture_from_hf_config, hf_config_from_architecture
from test_hf_support import hf_config

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"

# Qwen/Qwen3-30B-A3B's config.json as published (transformers 4.51 keys: num_experts, rope_theta,
# torch_dtype, rope_scaling null, sliding-window keys).
QWEN3_30B_A3B_CONFIG_JSON = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

HF_MATRIX = {
    "gqa2_norm": dict(),
    "gqa4_nonorm_top3": dict(num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                             norm_topk_prob=False),
    "mixed": dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2),
    "tied_mha": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=5e5),
}


@pytest.mark.parametrize("name", list(HF_MATRIX))
def test_transformers_5_config_maps_every_field(name):
    config = hf_config(**HF_MATRIX[name])
    arch = architecture_from_hf_config(config.to_dict())
    for field in Qwen3MoeArchitecture.field_names():
        if field == "rope_theta":
            expected = config.rope_parameters["rope_theta"]
        else:
            expected = getattr(config, field)
        if field == "mlp_only_layers":
            expected = tuple(expected)
        assert getattr(arch, field) == expected, field
    assert arch.moe_layer_pattern == [
        int(i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0)
        for i in range(config.num_hidden_layers)
    ]


@pytest.mark.parametrize("name", list(HF_MATRIX))
def test_inverse_round_trips_through_transformers(name, tmp_path):
    from transformers import Qwen3MoeConfig

    arch = architecture_from_hf_config(hf_config(**HF_MATRIX[name]).to_dict())
    written = hf_config_from_architecture(arch, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(written))
    rebuilt = Qwen3MoeConfig.from_pretrained(tmp_path)
    assert architecture_from_hf_config(rebuilt.to_dict()) == arch
    assert architecture_from_hf_config(tmp_path) == arch


def test_published_qwen3_30b_a3b_config_and_yaml_agree(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG_JSON))
    from_json = architecture_from_hf_config(tmp_path / "config.json")
    from_yaml = architecture_from_hf_config(MODELS / "qwen3_30b_a3b.yaml")
    assert from_json == from_yaml
    assert (from_yaml.num_hidden_layers, from_yaml.num_experts, from_yaml.num_experts_per_tok) == (48, 128, 8)
    assert from_yaml.num_moe_layers == 48 and from_yaml.norm_topk_prob and from_yaml.rope_theta == 1e6


def test_tiny_cpu_yaml_mixes_dense_and_moe():
    arch = architecture_from_hf_config(MODELS / "tiny_cpu.yaml")
    assert arch.moe_layer_pattern == [0, 1, 1, 1]
    assert arch.num_experts % 2 == 0 and arch.num_key_value_heads % 2 == 0  # TP=2 / EP=2 layouts divide it


@pytest.mark.parametrize("key, value, words", [
    ("shared_expert_intermediate_size", 512, "'shared_expert_intermediate_size'"),  # a Qwen2-MoE field
    ("layer_types", ["full_attention"], "'layer_types'"),
    ("attention_bias", True, "'attention_bias' = True"),
    ("use_sliding_window", True, "'use_sliding_window' = True"),
    ("hidden_act", "gelu", "'hidden_act' = 'gelu'"),
    ("attention_dropout", 0.1, "'attention_dropout' = 0.1"),
    ("rope_parameters", {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}, "rope_parameters"),
    ("rope_parameters", {"rope_theta": 1e6, "rope_type": "dynamic"}, "'dynamic'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'rope_scaling'"),
    ("model_type", "qwen2_moe", "'model_type' = 'qwen2_moe'"),
    ("quantization_config", {"quant_method": "fp8"}, "'quantization_config'"),
    ("num_local_experts", 8, "'num_experts' (4) and 'num_local_experts' (8)"),
    ("norm_topk_prob", "yes", "'norm_topk_prob' must be true or false"),
    ("head_dim", 8.5, "'head_dim' must be an integer"),
])
def test_unknown_keys_and_unsupported_values_are_named(key, value, words):
    config = dict(QWEN3_30B_A3B_CONFIG_JSON, num_experts=4, num_experts_per_tok=2)
    config[key] = value
    with pytest.raises(HfConfigError) as error:
        architecture_from_hf_config(config)
    assert words in str(error.value)


def test_missing_required_key_is_named():
    config = dict(QWEN3_30B_A3B_CONFIG_JSON)
    del config["moe_intermediate_size"]
    with pytest.raises(HfConfigError, match="moe_intermediate_size"):
        architecture_from_hf_config(config)


def test_defaults_follow_transformers_when_keys_are_absent():
    config = {k: v for k, v in QWEN3_30B_A3B_CONFIG_JSON.items()
              if k not in ("head_dim", "num_key_value_heads", "norm_topk_prob", "rope_theta")}
    arch = architecture_from_hf_config(config)
    assert arch.head_dim == 2048 // 32 and arch.num_key_value_heads == 32 and arch.norm_topk_prob is False
    assert arch.rope_theta == 10000.0
