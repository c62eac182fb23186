"""HF checkpoint <-> Megatron conversion: name/layout table, validation errors, and import/export bit for bit.

1-process tests work on the table (in-memory state dicts, safetensors headers); one 2-rank gloo run covers
what needs a model: PP=2 (layer offsets, mixed dense/MoE models), a
bfloat16 checkpoint at TP=2+EP=2 in the fused layout, the bytes each rank reads, and the errors raised
through `load_hf_checkpoint` on a real model. Logit parity is in test_hf_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe.hf_checkpoint import (FUSED, PER_EXPERT, CheckpointError, SafetensorsSource, detect_expert_layout,
                               hf_state_dict_from_megatron, hf_tensor_shapes, inspect_hf_checkpoint,
                               megatron_plan, megatron_state_dict_from_hf)
from moe.hf_config import architecture_from_hf_config
from multiprocess import run_distributed
from test_hf_support import make_hf_model, save_checkpoint

MIXED = dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1)


def _arch(model):
    return architecture_from_hf_config(model.config.to_dict())


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _assert_bitwise_equal(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{what}: {key} differs"


# ---------------------------------------------------------------------------------------------- the table


def test_plan_matches_megatron_layout_and_hf_names():
    model = make_hf_model(dict(num_attention_heads=8, num_key_value_heads=2, **MIXED))
    arch = _arch(model)
    hf = model.state_dict()
    assert set(hf_tensor_shapes(arch, FUSED)) == set(hf)
    full = megatron_state_dict_from_hf(hf, arch)
    # linear_qkv interleaves per KV group: [q heads of g (4 * d rows); k_g; v_g].
    d, per_group = arch.head_dim, 4
    q, k, v = (hf[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv")
    qkv = full["decoder.layers.2.self_attention.linear_qkv.weight"].reshape(2, (per_group + 2) * d, -1)
    for g in range(2):
        assert torch.equal(qkv[g, :per_group * d], q[g * per_group * d:(g + 1) * per_group * d])
        assert torch.equal(qkv[g, per_group * d:(per_group + 1) * d], k[g * d:(g + 1) * d])
        assert torch.equal(qkv[g, (per_group + 1) * d:], v[g * d:(g + 1) * d])
    # experts: fc1 = gate_up_proj[e] = [gate; up] (gate first, as transformers' own converter fuses them)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(full["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"], gate_up[3])
    assert torch.equal(full["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"],
                       hf["model.layers.1.mlp.experts.down_proj"][3])
    # dense layer 0: fc1 = [gate_proj; up_proj]
    assert torch.equal(full["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(full["decoder.layers.1.pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(full["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    assert torch.equal(full["output_layer.weight"], hf["lm_head.weight"])
    assert {n: tuple(t.shape) for n, t in full.items()} == {n: e.shape for n, e in megatron_plan(arch).items()}
    # and back, bit for bit
    _assert_bitwise_equal(hf, hf_state_dict_from_megatron(full, arch, FUSED), "fused round trip")


def test_fused_and_per_expert_layouts_hold_the_same_tensors(tmp_path):
    """Our per-expert conversion of the fused 5.x tensors is exactly what transformers' save_pretrained writes."""
    model = make_hf_model(MIXED)
    arch = _arch(model)
    save_checkpoint(model, tmp_path, PER_EXPERT)
    written_by_transformers = _load_dir(tmp_path)
    assert detect_expert_layout(written_by_transformers) == PER_EXPERT
    ours = hf_state_dict_from_megatron(megatron_state_dict_from_hf(model.state_dict(), arch), arch, PER_EXPERT)
    _assert_bitwise_equal(written_by_transformers, ours, "per-expert")
    full_from_per_expert = megatron_state_dict_from_hf(written_by_transformers, arch)
    _assert_bitwise_equal(megatron_state_dict_from_hf(model.state_dict(), arch), full_from_per_expert, "Megatron")


def test_folder_writer_takes_any_bucket_split_and_names_what_is_wrong(tmp_path):
    """HFFolderWriter (the one HF folder writer): a fused-layout export streamed one Megatron tensor at a time
    equals the whole state at once, tensor for tensor, and in transformers' hands; a repeated, unknown or
    missing tensor is a CheckpointError naming it."""
    from transformers import Qwen3MoeForCausalLM

    from moe.hf_checkpoint import HFFolderWriter

    model = make_hf_model(MIXED)
    arch = _arch(model)
    full = megatron_state_dict_from_hf(model.state_dict(), arch)
    (tmp_path / "whole").mkdir()
    whole = HFFolderWriter(tmp_path / "whole", arch, expert_layout=FUSED)
    whole.add(full)
    assert whole.finish() == ["model.safetensors", "config.json"]
    (tmp_path / "stream").mkdir()
    stream = HFFolderWriter(tmp_path / "stream", arch, expert_layout=FUSED, max_shard_bytes=20_000)
    for name in reversed(list(full)):  # fused experts complete only when the last expert of a layer arrives
        stream.add({name: full[name]})
    files = stream.finish()
    assert "model.safetensors.index.json" in files and len(files) > 3
    _assert_bitwise_equal(_load_dir(tmp_path / "whole"), _load_dir(tmp_path / "stream"), "streamed")
    _assert_bitwise_equal(_load_dir(tmp_path / "stream"), {k: v for k, v in model.state_dict().items()}, "hf")
    reloaded = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "stream"))
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)

    (tmp_path / "bad").mkdir()
    bad = HFFolderWriter(tmp_path / "bad", arch)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    bad.add({name: full[name]})
    with pytest.raises(CheckpointError, match="hold decoder.layers.0.self_attention.linear_proj.weight more than once"):
        bad.add({name: full[name]})
    with pytest.raises(CheckpointError, match="'decoder.layers.0.extra.weight' .* has no counterpart"):
        bad.add({"decoder.layers.0.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"lacked \d+ Megatron tensor\(s\) of this architecture, e.g. \['embedding"):
        bad.finish()


def test_tied_embeddings_have_no_lm_head():
    model = make_hf_model(dict(tie_word_embeddings=True))
    arch = _arch(model)
    hf = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    full = megatron_state_dict_from_hf(hf, arch)
    assert "output_layer.weight" not in full
    _assert_bitwise_equal(hf, hf_state_dict_from_megatron(full, arch, FUSED), "tied")


# ------------------------------------------------------------------------------------- validation errors


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    model = make_hf_model(MIXED)
    path = save_checkpoint(model, tmp_path_factory.mktemp("good"), FUSED)
    return model, path


def _corrupt(good, path: Path, edit) -> Path:
    from safetensors.torch import save_file

    model, _ = good
    state = {k: v.clone() for k, v in model.state_dict().items()}
    edit(state)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


CORRUPTIONS = {
    "missing": (lambda s: s.pop("model.layers.2.self_attn.k_norm.weight"),
                ["model.layers.2.self_attn.k_norm.weight", "expected shape (8,)", "missing"]),
    "wrong_shape": (lambda s: s.__setitem__("model.layers.1.mlp.experts.down_proj", torch.zeros(4, 32, 15)),
                    ["model.layers.1.mlp.experts.down_proj", "expected shape (4, 32, 16)",
                     "checkpoint has shape (4, 32, 15)"]),
    "unexpected": (lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(4)),
                   ["model.layers.0.self_attn.rotary_emb.inv_freq", "unexpected tensor of shape (4,)"]),
    "wrong_dense_shape": (lambda s: s.__setitem__("model.layers.0.mlp.gate_proj.weight", torch.zeros(41, 32)),
                          ["model.layers.0.mlp.gate_proj.weight", "expected shape (40, 32)", "has shape (41, 32)"]),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_bad_checkpoint_names_tensor_and_both_shapes(kind, good_checkpoint, tmp_path):
    edit, words = CORRUPTIONS[kind]
    path = _corrupt(good_checkpoint, tmp_path, edit)
    with pytest.raises(CheckpointError) as error:
        inspect_hf_checkpoint(path, _arch(good_checkpoint[0]))
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_mixed_expert_layouts_and_inconsistent_index_raise(good_checkpoint, tmp_path):
    def add_per_expert(state):
        state["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.zeros(16, 32)

    with pytest.raises(CheckpointError, match="mixes fused expert tensors"):
        inspect_hf_checkpoint(_corrupt(good_checkpoint, tmp_path / "mixed", add_per_expert), _arch(good_checkpoint[0]))

    model, _ = good_checkpoint
    sharded = save_checkpoint(model, tmp_path / "sharded", FUSED, shard_kb=16)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    key = "model.norm.weight"
    index["weight_map"][key] = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][key])
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="maps 'model.norm.weight'"):
        SafetensorsSource(sharded)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        SafetensorsSource(tmp_path / "nowhere")


def test_config_json_must_describe_the_model(good_checkpoint, tmp_path):
    import dataclasses

    from moe.hf_checkpoint import load_hf_checkpoint

    model, path = good_checkpoint
    other = dataclasses.replace(_arch(model), norm_topk_prob=False)
    with pytest.raises(CheckpointError, match="norm_topk_prob: model False, checkpoint config.json True"):
        load_hf_checkpoint(None, path, other)


# ------------------------------------------------------------------------- import / export on real models

PP_LAYOUTS = {
    "pp2": dict(pipeline_parallel=2),
    "tp2_ep2": dict(tensor_parallel=2, expert_parallel=2),
    "tp2_etp2": dict(tensor_parallel=2, expert_tensor_parallel=2),
}


def _roundtrip_body(rank, world_size, cases):
    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from moe.model import build_model
    from moe.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    apply_cpu_shim()
    out = {}
    for name, (checkpoint, export, layout_kwargs, dtype_name, export_layout) in cases.items():
        arch = architecture_from_hf_config(checkpoint)
        layout = ParallelLayout(**layout_kwargs)
        initialize_model_parallel(layout)
        initialize_cpu_rng(0)
        model = build_model(arch, layout, params_dtype=getattr(torch, dtype_name))
        report = load_hf_checkpoint(model, checkpoint)
        local_elements = sum(p.numel() for p in model.parameters())
        files = save_hf_checkpoint(model, export, arch, expert_layout=export_layout, max_shard_bytes=30_000)
        # The same model handed a corrupted checkpoint: the error names the tensor and both shapes.
        bad = Path(export).parent / f"{name}-bad"
        error = None
        if rank == 0:
            import shutil

            shutil.copytree(checkpoint, bad)
        torch.distributed.barrier()
        index = bad / "model.safetensors.index.json"
        from safetensors.torch import load_file, save_file

        shard = bad / sorted(json.loads(index.read_text())["weight_map"].values())[-1] if index.exists() \
            else bad / "model.safetensors"
        if rank == 0:
            tensors = load_file(str(shard))
            victim = sorted(tensors)[0]
            tensors[victim] = torch.zeros(*tensors[victim].shape[:-1], tensors[victim].shape[-1] + 1,
                                          dtype=tensors[victim].dtype)
            save_file(tensors, str(shard), metadata={"format": "pt"})
        torch.distributed.barrier()
        try:
            load_hf_checkpoint(model, bad)
        except CheckpointError as exc:
            error = str(exc)
        out[name] = dict(report=report, local_elements=local_elements, files=files, error=error)
        del model
        destroy_model_parallel()
    return out


@pytest.mark.multiprocess
def test_import_export_bit_for_bit_at_pp2_and_bf16_tp2_ep2(tmp_path):
    """PP=2 (dense layer 0 then MoE; decoder_sparse_step=2), TP=2+EP=2 and TP=2+ETP=2 in bfloat16 with the fused layout:
    every rank reads exactly its shard; the export equals the input tensor for tensor, bit for bit."""
    mixed = make_hf_model(MIXED, seed=3)
    # (tied models are covered at TP/EP layouts in test_hf_parity.py and at PP=2 in
    # tests/test_pipeline_parallel_moe.py)
    sparse = make_hf_model(dict(MIXED, decoder_sparse_step=2), seed=4)
    bf16 = make_hf_model(dict(num_experts=8, num_experts_per_tok=2), seed=5, dtype=torch.bfloat16)
    sources = {
        "pp2": (mixed, PER_EXPERT, 20, torch.float32, "pp2"),
        "pp2_sparse_step": (sparse, FUSED, None, torch.float32, "pp2"),
        "bf16_tp2_ep2": (bf16, FUSED, 20, torch.bfloat16, "tp2_ep2"),
        "bf16_tp2_etp2": (bf16, FUSED, None, torch.bfloat16, "tp2_etp2"),
    }
    cases = {}
    for name, (model, layout, shard_kb, dtype, parallel) in sources.items():
        checkpoint = save_checkpoint(model, tmp_path / name / "hf", layout, shard_kb)
        cases[name] = (str(checkpoint), str(tmp_path / name / "export"), PP_LAYOUTS[parallel],
                       str(dtype).removeprefix("torch."), layout)
    results = run_distributed(_roundtrip_body, world_size=2, args=(cases,), timeout_s=300)

    for name, (model, layout, shard_kb, dtype, parallel) in sources.items():
        original = _load_dir(tmp_path / name / "hf")
        exported = _load_dir(tmp_path / name / "export")
        _assert_bitwise_equal(original, exported, name)
        config = json.loads((tmp_path / name / "export" / "config.json").read_text())
        assert architecture_from_hf_config(config) == _arch(model) and config["dtype"] == str(dtype).removeprefix("torch.")
        total = sum(t.numel() for t in original.values())
        for rank, result in enumerate(results):
            report = result[name]
            assert report["report"]["expert_layout"] == layout
            # each rank reads exactly its own parameters' elements, a strict part of the checkpoint
            assert report["report"]["elements_read"] == report["local_elements"], (name, rank)
            assert report["local_elements"] < total, (name, rank)
            assert report["error"] is not None and "expected shape" in report["error"] and "checkpoint has shape" \
                in report["error"], (name, rank, report["error"])
        assert len(results[0][name]["files"]) > 2 if shard_kb else True  # sharded export: shards + index
