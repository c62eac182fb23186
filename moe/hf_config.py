"""Hugging Face `Qwen3MoeConfig` fields <-> `Qwen3MoeArchitecture`, both directions, strictly.

`architecture_from_hf_config` accepts a dict, a `config.json`, a checkpoint directory holding one, or a
YAML file with the same keys (configs/models/*.yaml). Every key of the input falls in exactly one class:

* `_FIELD_KEYS`: carried into the architecture (HF name -> dataclass field; `num_local_experts`, the
  name `Qwen3MoeConfig.to_dict()` writes in transformers 5.x, is an alias of `num_experts`);
* `_CONSTRAINED_KEYS`: a feature of the HF model that we do not implement; accepted only at the value
  that switches it off (`attention_bias: false`, `hidden_act: "silu"`, `rope_type: "default"`...), any
  other value raises naming the key and the value;
* `_IGNORED_KEYS`: generic `PreTrainedConfig` / generation / tokenizer keys with no architecture
  meaning (`dtype`, `use_cache`, `bos_token_id`, `id2label`, ...);

and any other key raises `HfConfigError` naming it: a field we do not understand is never silently
dropped. `hf_config_from_architecture` is the inverse, used to write the `config.json` of an export.
"""

from __future__ import annotations

import math
import os
import reprlib
from pathlib import Path
from typing import Any, Mapping

from moe.architecture import ArchitectureError, Qwen3MoeArchitecture
from moe.json_files import JsonFileError, read_json
from moe.yaml_files import YamlFileError, read_yaml

MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"


class HfConfigError(ArchitectureError):
    """A Hugging Face config key is unknown, or holds a value this implementation does not support."""


# A key or value quoted in an error is cut to a readable size: config.json is user input, and a 10 MB string
# (or, from YAML, an alias bomb of billions of elements) must not become a 10 MB error line.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3


def _shown(value: Any, limit: int = 200) -> str:
    text = _REPR.repr(value)  # reprlib never writes the whole nested value out
    return text if len(text) <= limit else text[:limit] + "..."


# HF key -> Qwen3MoeArchitecture field.
_FIELD_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "moe_intermediate_size": "moe_intermediate_size",
    "num_experts": "num_experts",
    "num_local_experts": "num_experts",  # transformers 5.x attribute_map alias
    "num_experts_per_tok": "num_experts_per_tok",
    "norm_topk_prob": "norm_topk_prob",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",  # transformers 4.x; 5.x nests it in rope_parameters
    "tie_word_embeddings": "tie_word_embeddings",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
    "max_position_embeddings": "max_position_embeddings",
    "initializer_range": "initializer_range",
}

_INT_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
               "decoder_sparse_step", "max_position_embeddings"}
_FLOAT_FIELDS = {"router_aux_loss_coef", "rms_norm_eps", "rope_theta", "initializer_range"}
_BOOL_FIELDS = {"norm_topk_prob", "tie_word_embeddings"}

# Keys whose only supported value switches an unimplemented feature off. key -> (is_supported, wanted).
_CONSTRAINED_KEYS: dict[str, tuple[Any, str]] = {
    "model_type": (lambda v: v == MODEL_TYPE, f"{MODEL_TYPE!r}"),
    "architectures": (lambda v: v is None or list(v) == [HF_ARCHITECTURE], f"[{HF_ARCHITECTURE!r}]"),
    "hidden_act": (lambda v: v == "silu", "'silu'"),
    "attention_bias": (lambda v: v is False, "false"),
    "attention_dropout": (lambda v: not isinstance(v, bool) and float(v) == 0.0, "0.0"),
    "use_sliding_window": (lambda v: v is False, "false"),
    "rope_scaling": (lambda v: v is None or (isinstance(v, Mapping) and v.get("rope_type", v.get("type"))
                                                in ("default", None) and set(v) <= {"rope_type", "type", "rope_theta"}),
                     "null (no RoPE scaling)"),
    "quantization_config": (lambda v: v is None, "absent (quantized checkpoints are not supported)"),
}

# Keys that only mean something when a constrained feature is on (checked above), so ignored here.
_DEPENDENT_KEYS = {
    "sliding_window": "use_sliding_window",
    "max_window_layers": "use_sliding_window",
}

# Generic PreTrainedConfig / generation / tokenizer keys: no architecture meaning.
_IGNORED_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "_name_or_path", "name_or_path",
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "id2label",
    "label2id", "num_labels", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "_commit_hash",
    "_attn_implementation", "attn_implementation", "_experts_implementation", "experts_implementation",
    "use_bfloat16", "tie_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "pruned_heads", "torchscript", "tf_legacy_loss", "use_return_dict",
    # generation defaults some older configs carry (transformers pops them into GenerationConfig)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})


def _rope_parameters(value: Any) -> float | None:
    """rope_theta from transformers 5.x `rope_parameters`; anything but plain default RoPE raises."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise HfConfigError(f"config key 'rope_parameters' must be a mapping, got {_shown(value)}")
    extra = set(value) - {"rope_theta", "rope_type", "type"}
    if extra:
        raise HfConfigError(
            f"config key 'rope_parameters' holds {_shown(sorted(extra))}: only default RoPE (rope_theta, "
            f"rope_type='default') is supported, got {_shown(dict(value))}"
        )
    rope_type = value.get("rope_type", value.get("type", "default"))
    if rope_type != "default":
        raise HfConfigError(f"config key 'rope_parameters.rope_type' = {_shown(rope_type)} is not supported "
                            "(only 'default' RoPE)")
    return value.get("rope_theta")


def _coerce(field_name: str, hf_key: str, value: Any) -> Any:
    if field_name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise HfConfigError(f"config key {_shown(hf_key)} must be an integer, got {_shown(value)}")
        return value
    if field_name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HfConfigError(f"config key {_shown(hf_key)} must be a number, got {_shown(value)}")
        return float(value)
    if field_name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise HfConfigError(f"config key {_shown(hf_key)} must be true or false, got {_shown(value)}")
        return value
    if field_name == "mlp_only_layers":
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
            raise HfConfigError(f"config key 'mlp_only_layers' must be a list of layer indices, got {_shown(value)}")
        return tuple(value)
    raise AssertionError(field_name)


def load_config_dict(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The raw key -> value mapping of a dict, a config.json, a checkpoint directory, or a YAML file."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HfConfigError(f"no Hugging Face config at {path}")
    if path.suffix in (".yaml", ".yml"):
        try:
            data = read_yaml(path)
        except YamlFileError as exc:
            raise HfConfigError(str(exc)) from None
    else:
        try:
            data = read_json(path, want=None)
        except JsonFileError as exc:
            raise HfConfigError(str(exc)) from None
    if not isinstance(data, Mapping):
        raise HfConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return dict(data)


def architecture_from_hf_config(source: str | os.PathLike | Mapping[str, Any]) -> Qwen3MoeArchitecture:
    """A validated `Qwen3MoeArchitecture` from HF config keys; unknown keys or unsupported values raise."""
    config = load_config_dict(source)
    fields: dict[str, Any] = {}
    origin: dict[str, str] = {}  # field -> the HF key it came from, for conflict messages

    def put(field_name: str, hf_key: str, value: Any) -> None:
        value = _coerce(field_name, hf_key, value)
        if field_name in fields and fields[field_name] != value:
            raise HfConfigError(
                f"config keys {origin[field_name]!r} ({_shown(fields[field_name])}) and {_shown(hf_key)} "
                f"({_shown(value)}) disagree on {field_name}"
            )
        fields[field_name] = value
        origin[field_name] = hf_key

    for key, value in config.items():
        if key in _FIELD_KEYS:
            if key == "head_dim" and value is None:
                continue
            if key == "rope_theta" and value is None:
                continue
            put(_FIELD_KEYS[key], key, value)
        elif key == "rope_parameters":
            theta = _rope_parameters(value)
            if theta is not None:
                put("rope_theta", "rope_parameters.rope_theta", theta)
        elif key in _CONSTRAINED_KEYS:
            supported, wanted = _CONSTRAINED_KEYS[key]
            try:
                ok = supported(value)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise HfConfigError(f"config key {_shown(key)} = {_shown(value)} is not supported (supported: {wanted})")
        elif key in _DEPENDENT_KEYS or key in _IGNORED_KEYS:
            continue
        else:
            raise HfConfigError(
                f"config key {_shown(key)} (= {_shown(value)}) is not supported by the Qwen3-MoE model builder; "
                "it is neither an architecture field nor a known key without architecture meaning"
            )

    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
                "num_experts", "num_experts_per_tok")
    missing = [name for name in required if name not in fields]
    if missing:
        raise HfConfigError(f"config lacks required key(s) {missing}")
    # HF defaults for keys a config may omit (Qwen3MoeConfig / Qwen3MoeAttention).
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    if "head_dim" not in fields:
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise HfConfigError("config lacks 'head_dim' and hidden_size is not divisible by num_attention_heads")
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields.setdefault("norm_topk_prob", False)  # Qwen3MoeConfig's default (Qwen3-30B-A3B sets true)
    fields.setdefault("rope_theta", 10000.0)  # transformers' default when a config names none
    return Qwen3MoeArchitecture(**fields)


def hf_config_from_architecture(arch: Qwen3MoeArchitecture, dtype: str = "bfloat16",
                                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers 5.x `config.json` dict for `arch` (`Qwen3MoeConfig(**d)` rebuilds it).

    `extra` adds keys without architecture meaning (token ids...); they must be in the ignored set.
    """
    rope_theta = float(arch.rope_theta)
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "num_experts": arch.num_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "norm_topk_prob": arch.norm_topk_prob,
        "router_aux_loss_coef": float(arch.router_aux_loss_coef),
        "rms_norm_eps": float(arch.rms_norm_eps),
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "tie_word_embeddings": arch.tie_word_embeddings,
        "decoder_sparse_step": arch.decoder_sparse_step,
        "mlp_only_layers": list(arch.mlp_only_layers),
        "max_position_embeddings": arch.max_position_embeddings,
        "initializer_range": float(arch.initializer_range),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "dtype": dtype,
        "use_cache": True,
    }
    for key, value in (extra or {}).items():
        if key not in _IGNORED_KEYS:
            raise HfConfigError(f"extra config key {_shown(key)} is not a key without architecture meaning")
        config[key] = value
    if not math.isfinite(rope_theta):
        raise HfConfigError(f"rope_theta must be finite, got {_shown(rope_theta)}")
    return config


def supported_keys() -> dict[str, list[str]]:
    """The three key classes, for documentation and tests."""
    return {
        "fields": sorted(_FIELD_KEYS) + ["rope_parameters"],
        "constrained": sorted(_CONSTRAINED_KEYS),
        "ignored": sorted(_IGNORED_KEYS | set(_DEPENDENT_KEYS)),
    }
