"""Our Megatron Qwen3-MoE computes transformers' `Qwen3MoeForCausalLM` function at every layout.

For each tiny random config (GQA ratios 2 and 4 and 1, top-1/2/3, norm_topk_prob on and off, a model mixing
dense and MoE layers, tied embeddings), the HF checkpoint is imported into Megatron at TP=1, TP=2, EP=2
and TP=2+EP=2 on 2 gloo ranks (both dispatchers), and exported back from every layout:

* logits equal HF's eager float32 logits: |Δ| <= 2e-6 * max|logits_HF| (measured: ~1e-7 relative, a few
  float32 ulps of the largest logit; the reductions differ only in order/split);
* the top-k experts chosen per token per MoE layer are the same sets (hook on HF's `mlp.gate`, and on
  Megatron's `mlp.router`, whose output is (probs, routing_map));
* the export from every layout (in the expert layout of the input) reproduces every tensor of the imported checkpoint bit for bit, and
  `Qwen3MoeForCausalLM.from_pretrained` loads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multiprocess import run_distributed
from test_hf_support import hf_logits_and_routes, make_hf_model, save_checkpoint

REL_TOL = 2e-6
_BATCH, _SEQ = 2, 8

LAYOUTS = {
    "tp1": dict(),
    "tp2": dict(tensor_parallel=2),
    "ep2": dict(expert_parallel=2),
    "tp2_ep2": dict(tensor_parallel=2, expert_parallel=2),
}

# name -> (HF config overrides, checkpoint expert layout, shard size in kB or None, token dispatcher)
CONFIGS = {
    # GQA 2:1, top-2 of 4, norm_topk_prob on; transformers' own save_pretrained (per-expert), sharded
    "gqa2_top2_norm": (dict(), "per_expert", 24, "alltoall"),
    # GQA 4:1, top-3 of 8, norm_topk_prob off; fused 5.x layout, single file
    "gqa4_top3_nonorm": (dict(num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                              norm_topk_prob=False), "fused", None, "alltoall"),
    # dense layer 0 (mlp_only_layers) + decoder_sparse_step 2 → layers 1, 3 MoE; top-1, norm off; fused, sharded
    "mixed_dense_moe": (dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2, num_experts_per_tok=1,
                             norm_topk_prob=False), "fused", 16, "allgather"),
    # MHA (GQA 1:1), tied embeddings, top-2 of 4, norm on; per-expert single file
    "mha_tied_top2": (dict(num_key_value_heads=4, tie_word_embeddings=True), "per_expert", None, "alltoall"),
}


def _routes_of(model, store):
    """Forward hooks on every MoE router: store[layer] = routing_map [tokens_local, E] (tokens seq-major)."""
    handles = []
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue

        def hook(module, args, output, number=layer.layer_number - 1):
            _, routing_map = output
            store[number] = routing_map.detach().clone()

        handles.append(router.register_forward_hook(hook))
    return handles


def _body(rank, world_size, jobs):
    """Every config at every layout in one spawned pair of ranks (Megatron's import costs ~5-8 s a process)."""
    from megatron.core import parallel_state as ps

    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from moe.hf_config import architecture_from_hf_config
    from moe.model import build_model, forward_logits
    from moe.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    apply_cpu_shim()
    results = {}
    for config, (checkpoint, export_root, dispatcher, input_ids_BS) in jobs.items():
        arch = architecture_from_hf_config(checkpoint)
        for name, layout_kwargs in LAYOUTS.items():
            layout = ParallelLayout(**layout_kwargs)
            initialize_model_parallel(layout)
            initialize_cpu_rng(1234)
            model = build_model(arch, layout, token_dispatcher=dispatcher).eval()
            report = load_hf_checkpoint(model, checkpoint)
            routes: dict[int, torch.Tensor] = {}
            handles = _routes_of(model, routes)
            with torch.no_grad():
                logits = forward_logits(model, input_ids_BS)
            for handle in handles:
                handle.remove()
            # Exported in the layout it came in, so the comparison is key for key, bit for bit.
            save_hf_checkpoint(model, Path(export_root) / name, arch, expert_layout=report["expert_layout"],
                               max_shard_bytes=12_000)
            results[(config, name)] = dict(logits=logits, routes=routes, tp_rank=ps.get_tensor_model_parallel_rank(),
                                           tp_size=ps.get_tensor_model_parallel_world_size())
            del model
            destroy_model_parallel()
    return results


def _assemble(per_rank, batch, seq):
    """Full logits [B, S, V] and routes {layer: sorted top-k [B, S, k]} from every rank's shards."""
    by_tp = {r["tp_rank"]: r for r in per_rank}  # TP groups hold identical copies on other (DP) ranks
    size = per_rank[0]["tp_size"]
    logits = torch.cat([by_tp[t]["logits"] for t in range(size)], dim=-1)
    routes = {}
    for layer in by_tp[0]["routes"]:
        # Sequence parallelism: rank t routes tokens of sequence chunk t, [S/TP * B, E] seq-major.
        maps = [by_tp[t]["routes"][layer].reshape(seq // size, batch, -1) for t in range(size)]
        routing_map_SBE = torch.cat(maps, dim=0)
        k = int(routing_map_SBE.sum(-1).unique().item())
        ids = routing_map_SBE.nonzero()[:, 2].reshape(seq, batch, k)  # nonzero is row-major: sorted ids
        routes[layer] = ids.transpose(0, 1)
    return logits, routes


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    """HF models, checkpoints and references for every config, and one distributed run over all of them."""
    root = tmp_path_factory.mktemp("hf_parity")
    cases, jobs = {}, {}
    for index, (config, (overrides, expert_layout, shard_kb, dispatcher)) in enumerate(CONFIGS.items()):
        hf_model = make_hf_model(overrides, seed=index)
        checkpoint = save_checkpoint(hf_model, root / config / "hf", expert_layout, shard_kb)
        generator = torch.Generator().manual_seed(7 + index)
        input_ids_BS = torch.randint(0, hf_model.config.vocab_size, (_BATCH, _SEQ), generator=generator)
        ref_logits, ref_routes = hf_logits_and_routes(hf_model, input_ids_BS)
        cases[config] = dict(hf_model=hf_model, checkpoint=checkpoint, export=root / config / "export",
                             ref_logits=ref_logits, ref_routes=ref_routes)
        jobs[config] = (str(checkpoint), str(root / config / "export"), dispatcher, input_ids_BS)
    per_rank = run_distributed(_body, world_size=2, args=(jobs,), timeout_s=400)
    return cases, per_rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", list(CONFIGS))
def test_megatron_matches_transformers_at_every_layout(config, parity_run):
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    cases, per_rank = parity_run
    case = cases[config]
    ref_logits, ref_routes, hf_model = case["ref_logits"], case["ref_routes"], case["hf_model"]
    original = _read_all(case["checkpoint"], load_file)
    atol = REL_TOL * float(ref_logits.abs().max())
    for layout in LAYOUTS:
        logits, routes = _assemble([r[(config, layout)] for r in per_rank], _BATCH, _SEQ)
        delta = float((logits - ref_logits).abs().max())
        print(f"{config} {layout}: max|Δlogits| = {delta:.3e} (max|logits| {float(ref_logits.abs().max()):.3f}, "
              f"atol {atol:.2e})")
        assert delta <= atol, f"{config} {layout}: max|Δlogits| {delta:.3e} > {atol:.3e}"
        assert sorted(routes) == sorted(ref_routes), f"{config} {layout}: MoE layers {sorted(routes)} vs HF {sorted(ref_routes)}"
        for layer, ids in ref_routes.items():
            mismatch = (routes[layer] != ids).any(-1)
            assert not mismatch.any(), (
                f"{config} {layout} layer {layer}: top-k experts differ at (batch, position) "
                f"{mismatch.nonzero().tolist()}: ours {routes[layer][mismatch].tolist()} vs HF {ids[mismatch].tolist()}")
        # Export from this layout: every tensor bit for bit, and loadable by transformers.
        exported = _read_all(case["export"] / layout, load_file)
        _assert_same_tensors(original, exported, f"{config} {layout} export")
    reloaded = Qwen3MoeForCausalLM.from_pretrained(case["export"] / "tp2_ep2").eval()
    for key, tensor in hf_model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), f"{config}: from_pretrained({key}) differs"


def _read_all(path: Path, load_file) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _assert_same_tensors(original, exported, what):
    assert sorted(original) == sorted(exported), f"{what}: keys differ: {sorted(set(original) ^ set(exported))}"
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), f"{what}: {key} differs"
