"""`megagspo export`: a run's weights as a Hugging Face Qwen3MoeForCausalLM folder.

A run started from a Hugging Face folder (model.init_from) round-trips faithfully: the export holds that
folder's tokenizer files, generation_config.json and config.json copied byte for byte, and only the weights
written anew. The one config.json field training can change is the weights' dtype (`dtype` / `torch_dtype`):
the weights are written in the folder's dtype when that loses nothing of the trained values (the folder is
float32, or both are bf16), else in float32 with that field saying so. bos / eos / pad token ids, Qwen's sampling
defaults and the chat template are therefore the source's. No megagspo-private file is written.

Runs not started from a Hugging Face folder: config.json and generation_config.json from the run's architecture
and tokenizer (its ids, as the tokenizer folder defines them); an HF tokenizer folder's files copied byte for
byte (never re-serialised through a loader); the built-in tokenizer's vocabulary in megagspo_vocab.pt (it has
no Hugging Face form).
"""

from __future__ import annotations

import json
import os
import re
import shutil

from megagspo.data import load_tokenizer
from megagspo.data.tokenizer import BUILTIN_TOKENIZERS
from megagspo.rollout import HFRolloutEngine
from moe.architecture import Qwen3MoeArchitecture
from moe.hf_checkpoint import is_hf_model_folder
from moe.json_files import loads_bounded, read_json, read_json_text

# What a Hugging Face loader reads from a model folder besides the weights and config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
CONFIG = "config.json"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def source_folder(ckpt: dict) -> str:
    """model.init_from of the run when it is a Hugging Face model folder on this machine, else ""."""
    init_from = ((ckpt.get("config") or {}).get("model") or {}).get("init_from") or ""
    return init_from if init_from and is_hf_model_folder(init_from) else ""


def recorded_init_from(ckpt: dict) -> str:
    return ((ckpt.get("config") or {}).get("model") or {}).get("init_from") or ""


def _source_dtype(config: dict) -> tuple:
    """(key, value) of config.json's weight dtype field (transformers 5 writes `dtype`, older `torch_dtype`)."""
    for key in ("dtype", "torch_dtype"):
        if isinstance(config.get(key), str):
            return key, config[key]
    return "", ""


def export_dtype(source_dtype: str, precision: str) -> str:
    """The dtype the weights are written in: the source folder's when it holds the trained values exactly
    (float32 holds everything; bf16 holds a bf16 run's), else float32."""
    if source_dtype == "float32" or (source_dtype == "bfloat16" and precision == "bf16"):
        return source_dtype
    return "float32"


def config_with_dtype(text: str, key: str, old: str, new: str) -> str:
    """config.json's text with only its top-level `key` value changed from `old` to `new` (the rest of the
    bytes as they were)."""
    if old == new or not key:
        return text
    pattern = re.compile(r'("' + key + r'"\s*:\s*)"' + re.escape(old) + '"')
    changed, n = pattern.subn(lambda m: m.group(1) + json.dumps(new), text)
    before, after = loads_bounded(text, CONFIG), loads_bounded(changed, CONFIG) if n else None
    if n != 1 or after != {**before, key: new}:  # an unusual layout: re-serialise as transformers would
        return json.dumps({**before, key: new}, indent=2, sort_keys=True) + "\n"
    return changed


def export_hf(ckpt: dict, out: str) -> list:
    """Write the checkpoint `ckpt` (full_state.load_checkpoint) to the folder `out`; -> lines that say where
    each non-weight file came from."""
    import torch

    arch = Qwen3MoeArchitecture(**ckpt["arch"])
    tokenizer = load_tokenizer(ckpt["tokenizer"])
    engine = HFRolloutEngine(arch, tokenizer, record_routes=False)
    engine.update_weights(ckpt["state"])
    model = engine.model.to("cpu")
    source = source_folder(ckpt)
    tok_dir = "" if ckpt["tokenizer"] in BUILTIN_TOKENIZERS else ckpt["tokenizer"]
    notes = []
    for folder in (source, tok_dir):  # its generation_config.json is copied below: never pass on a hostile one
        if folder and os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):
            read_json(os.path.join(folder, GENERATION_CONFIG))
    os.makedirs(out, exist_ok=True)
    if source:
        config_text, config = read_json_text(os.path.join(source, CONFIG))  # bounded: size, depth, UTF-8
        key, old = _source_dtype(config)
        precision = ((ckpt.get("config") or {}).get("model") or {}).get("precision", "fp32")
        dtype = export_dtype(old, precision) if old in _DTYPES else "float32"
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(out)
        config_text = config_with_dtype(config_text, key, old, dtype) if old else config_text
        with open(os.path.join(out, CONFIG), "w", encoding="utf-8") as f:
            f.write(config_text)
        notes.append(f"config.json: {source}'s" + (f", {key} {old} -> {dtype} (the trained weights' dtype)"
                                                   if old and old != dtype else ", unchanged"))
        generation_from = source if os.path.isfile(os.path.join(source, GENERATION_CONFIG)) else ""
    else:
        model.save_pretrained(out)
        if recorded_init_from(ckpt) and not os.path.isfile(recorded_init_from(ckpt)):
            notes.append(f"model.init_from = {recorded_init_from(ckpt)!r} is not a Hugging Face folder on this "
                         "machine: config.json written from the run's architecture and tokenizer")
        generation_from = tok_dir if tok_dir and os.path.isfile(os.path.join(tok_dir, GENERATION_CONFIG)) else None
    written = os.path.join(out, GENERATION_CONFIG)
    if generation_from:
        shutil.copyfile(os.path.join(generation_from, GENERATION_CONFIG), written)
        notes.append(f"generation_config.json: copied from {generation_from}")
    elif generation_from == "" and os.path.exists(written):
        os.remove(written)  # the source folder has none: neither has its export
    if tok_dir:
        copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(tok_dir, name))]
        for name in copied:
            shutil.copyfile(os.path.join(tok_dir, name), os.path.join(out, name))
        notes.append(f"tokenizer: {', '.join(copied)} copied from {tok_dir}")
    else:
        torch.save({"vocab": tokenizer.itos}, os.path.join(out, "megagspo_vocab.pt"))
        notes.append("tokenizer: the built-in one (no Hugging Face form): its vocabulary in megagspo_vocab.pt")
    return notes
