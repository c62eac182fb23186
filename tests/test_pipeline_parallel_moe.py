"""The moe library under Megatron pipeline parallelism (PP = 2 on 2 gloo ranks, and PP = 2 x EP = 2 on 4),
against a PP = 1 model:

- a PP=2 model loaded from a PP=1 model's full state dict gathers back to exactly that dict on every rank
  (each stage renames its layers by Megatron's own layer offset and the stages exchange their tensors), for
  an even split (layers 0-1 | 2-3), an uneven one (`num_layers_in_first_pipeline_stage=1`: 0 | 1-3) and
  tied word embeddings (the last stage's copy of the embedding is loaded from it and left out of the gather);
  at PP=2 x EP=2 the experts are also gathered over EP inside each stage;
- gradients set from the full-model names (the same tensors on both layouts) in Megatron DDP's fp32 buffers
  give, through Megatron's finalize_model_grads and distributed optimizer (moe.optimizer), the same clipping
  norm and the same clipped gradients: the squares are summed over the pipeline stages, the tied embedding's
  copy is counted once, and its two copies' gradients are summed over the embedding group;
- a sharded checkpoint (weights, fp32 master weights, Adam moments and step of the distributed optimizer)
  saved at PP=2 loads at PP=1 bit for bit, one
  saved at PP=1 loads at PP=2 (even and uneven split) bit for bit, and one process rebuilds the full state
  dict from the PP=2 folder.

Weights and checkpoints are copies, so they are compared exactly. The clipping norm and the clipped
gradients depend on float32 summation order (per stage, then over stages): rtol 1e-6 (measured: at most
1.6e-7 relative, about 1 ulp, over 6 seeds), and the norm also against a float64 sum of the full
gradients. Each test draws a fresh seed and prints it (MEGAGSPO_TEST_SEED=N reruns one). No forward /
backward through a pipeline schedule here. The 2-rank PP=2 work runs once (`pp2_run`) for several tests:
each spawn costs ~6 s of start-up on 2 cores.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from devices import megatron_groups
from helpers import fresh_seed, tiny_arch
from multiprocess import run_distributed

# (label, tie_word_embeddings, build_model config overrides at PP=2)
VARIANTS = (
    ("even", False, {}),
    ("uneven", False, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}),
    ("tied", True, {}),
)
EXPECTED_OFFSETS = {"even": [0, 2], "uneven": [0, 1], "tied": [0, 2]}
EMBEDDING = "embedding.word_embeddings.weight"


def _arch(tie: bool):
    """4 layers (layer 0 dense, 1-3 MoE with 4 experts), so that both stages hold MoE layers."""
    return tiny_arch("mixed", num_hidden_layers=4, tie_word_embeddings=tie)


def _by_name(name: str, shape, seed: int) -> torch.Tensor:
    """A random tensor determined by the full-model name (crc32: stable across processes, unlike hash)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode())))


def _clip_with_megatron(model, local_grads: dict, max_norm: float):
    """Megatron's production path on this rank's model: DDP's fp32 buffers hold `local_grads`,
    finalize_model_grads reduces them (data-parallel average of identical replicas, tied-embedding sum), the
    distributed optimizer clips (its step at lr 0 changes no weight) -> (pre-clip norm, {local name: reduced
    gradient}, {local name: reduced and clipped gradient}, every shard gathered).

    Megatron's DDP scales every gradient by 1 / DP before summing it over its replicas: DP replicas of a
    dense weight, expert-DP replicas of an expert (the expert-DP group is smaller when EP > 1, because an
    expert's gradient already collects the tokens of every data-parallel rank of its EP group through the
    all-to-all). An expert's local gradient is therefore given as DP / expert-DP times the full-model one, as
    a backward pass would make it."""
    from megatron.core import parallel_state as ps

    from moe.optimizer import (
        OptimizerSettings,
        build_optimizer,
        finish_gradients,
        gather_reduced_gradients,
        optimizer_step,
        wrap_data_parallel,
    )

    ddp = wrap_data_parallel(model)
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=0.0, clip_grad=max_norm))
    from moe.sharding import is_expert_param

    expert_factor = ps.get_data_parallel_world_size() // ps.get_expert_data_parallel_world_size()
    for n, p in model.named_parameters():
        p.main_grad.copy_(local_grads[n] * (expert_factor if is_expert_param(n) else 1))
    finish_gradients(ddp)
    gather_reduced_gradients(ddp)
    reduced = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    norm = optimizer_step(optimizer)
    gather_reduced_gradients(ddp)
    return norm, reduced, {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _reference(arch, seed: int):
    """PP=1 on this rank (every rank its own replica): full weights, and the norm / clipped gradients of
    gradients drawn per full name, with max_norm half the norm so that clipping scales them."""
    from moe.model import build_model
    from moe.parallel import destroy_model_parallel

    megatron_groups()
    model = build_model(arch)
    full = {n: _by_name("w." + n, p.shape, seed) for n, p in model.named_parameters()}
    grads = {n: _by_name("g." + n, p.shape, seed) for n, p in model.named_parameters()}
    max_norm = 0.5 * float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    norm, _, clipped = _clip_with_megatron(model, grads, max_norm)
    destroy_model_parallel()
    return full, grads, max_norm, norm, clipped


def _gather_and_norm_body(rank, world_size, seed, layout_kwargs):
    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng

    apply_cpu_shim()
    initialize_cpu_rng(seed)
    return _gather_and_norm(seed, layout_kwargs)


def _gather_and_norm(seed, layout_kwargs):
    """Per variant: PP=1 reference, then the PP=2 (x layout_kwargs) model loaded from its full state dict,
    gathered, given the same gradients (sliced), reduced and clipped."""
    from megatron.core import parallel_state as ps

    from moe.model import build_model
    from moe.parallel import destroy_model_parallel
    from moe.sharding import full_names, gather_full_state_dict, layer_offset, load_full_state_dict

    reports = {}
    for label, tie, overrides in VARIANTS:
        if label != "even" and layout_kwargs:
            continue  # the 4-rank layouts: the even split is enough
        arch = _arch(tie)
        full, grads, max_norm, ref_norm, ref_clipped = _reference(arch, seed)
        layout = megatron_groups(pipeline_parallel=2, **layout_kwargs)
        model = build_model(arch, layout, **overrides)
        load_full_state_dict(model, full)
        gathered = gather_full_state_dict(model)
        names = full_names(model)
        params = dict(model.named_parameters())
        tied_copy_loaded = None
        if tie and not ps.is_pipeline_first_stage():
            tied_copy_loaded = torch.equal(params["output_layer.weight"], full[EMBEDDING])
        # The gradients of the full model, sliced for this rank; the tied embedding's gradient is split
        # between its two copies by a mask (each element on one copy, zero on the other, so the sum over
        # the embedding group is exact).
        pieces = _local_view(model, grads)
        local = {}
        for n, p in params.items():
            local[n] = pieces[n]
            if tie and names[n] == EMBEDDING:
                mask = _by_name("mask", p.shape, seed) > 0
                local[n] = torch.where(mask if n == EMBEDDING else ~mask, pieces[n], torch.zeros_like(pieces[n]))
        # every data-parallel replica (dense parameters at PP=2 x EP=2) holds the same gradient: DDP averages
        norm, reduced, clipped_local = _clip_with_megatron(model, local, max_norm)
        tied_grad_summed = None
        if tie and not ps.is_pipeline_first_stage():
            tied_grad_summed = torch.equal(reduced["output_layer.weight"], pieces["output_layer.weight"])
        clipped = gather_full_state_dict(model, clipped_local)
        tied_copy_clipped = None
        if tie and not ps.is_pipeline_first_stage():
            tied_copy_clipped = torch.equal(clipped_local["output_layer.weight"], clipped[EMBEDDING])
        offsets = [None] * ps.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(offsets, layer_offset(model), group=ps.get_pipeline_model_parallel_group())
        sizes = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                 ps.get_expert_model_parallel_world_size())
        destroy_model_parallel()
        reports[label] = dict(full=full, grads=grads, gathered=gathered, ref_norm=ref_norm, norm=norm,
                              ref_clipped=ref_clipped, clipped=clipped, offsets=offsets, sizes=sizes,
                              tied=(tied_copy_loaded, tied_grad_summed, tied_copy_clipped))
    return reports


def _local_view(model, full):
    from moe.sharding import local_view_of_full

    return local_view_of_full(model, full)


def _check_gather_and_norm(reports, seed, layout_kwargs):
    for rank, by_variant in enumerate(reports):
        assert set(by_variant) == ({"even"} if layout_kwargs else {v[0] for v in VARIANTS})
        for label, r in by_variant.items():
            where = f"seed {seed} rank {rank} {label}"
            assert r["sizes"] == (2, layout_kwargs.get("tensor_parallel", 1), layout_kwargs.get("expert_parallel", 1))
            assert r["offsets"] == EXPECTED_OFFSETS[label], where
            full, gathered = r["full"], r["gathered"]
            assert gathered.keys() == full.keys(), f"{where}: {sorted(set(gathered) ^ set(full))}"
            for name, tensor in full.items():
                assert torch.equal(gathered[name], tensor), f"{where}: {name} not gathered exactly"
            expected = float(torch.sqrt(sum(g.double().pow(2).sum() for g in r["grads"].values())))
            assert float(r["norm"]) == pytest.approx(expected, rel=1e-6), f"{where}: norm vs float64"
            assert float(r["norm"]) == pytest.approx(float(r["ref_norm"]), rel=1e-6), f"{where}: norm vs PP=1"
            assert r["clipped"].keys() == full.keys()
            for name, ref in r["ref_clipped"].items():
                torch.testing.assert_close(r["clipped"][name], ref, rtol=1e-6, atol=1e-9,
                                           msg=lambda m, n=name: f"{where}: clipped {n}: {m}")
            if label == "tied":
                # last stage: the copy was loaded from the embedding, its gradient became the sum of both
                # copies' (the full gradient), and it was clipped like the embedding
                assert r["tied"] == ((None, None, None) if rank == 0 else (True, True, True)), where


@pytest.mark.multiprocess
def test_pp2_gathers_the_full_state_dict_and_clips_like_pp1(pp2_run):
    """PP=2 on 2 ranks, for an even split, an uneven one and tied embeddings: load a PP=1 full state dict,
    gather it back exactly on every rank (Megatron's layer offsets [0, 2] / [0, 1]); gradients from the
    full names give the PP=1 clipping norm and clipped gradients. (Run by the `pp2_run` fixture.)"""
    _, seed, results = pp2_run
    _check_gather_and_norm([r["gather"] for r in results], seed, {})


@pytest.mark.multiprocess
def test_pp2_ep2_gathers_the_full_state_dict_and_clips_like_pp1():
    """PP=2 x EP=2 on 4 ranks (even split): experts are renamed by EP rank and by the stage's layer offset,
    gathered over EP within each stage, then exchanged over the pipeline; the dense parameters have 2
    data-parallel replicas (averaged: they hold the same gradient). Same checks as at PP=2.
    (PP=2 x TP=2 is left out to keep this file under a minute on 2 cores: finalize_model_grads would sum the
    sequence-parallel gradients over TP, so the test would have to split them between the TP ranks.)"""
    seed = fresh_seed()
    layout = {"expert_parallel": 2}
    reports = run_distributed(_gather_and_norm_body, world_size=4, args=(seed, layout), timeout_s=240)
    _check_gather_and_norm(reports, seed, layout)


# ------------------------------------------------------------------------------------- dist checkpoint
CHECKPOINT_VARIANTS = ("even", "tied")


def _adam_state(model, optimizer) -> dict:
    """Full-model distributed-optimizer state: fp32 master weights and exp_avg / exp_avg_sq gathered like the
    weights, and each parameter's step under its full name (collected from every rank)."""
    from moe.dist_checkpoint import local_optimizer_state
    from moe.sharding import full_names, gather_full_state_dict

    local = local_optimizer_state(model, optimizer)
    out = {}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        full = gather_full_state_dict(model, {n: state[kind] for n, state in local.items()})
        out.update({f"{kind}/{n}": t for n, t in full.items()})
    names = full_names(model)
    steps = {f"step/{names[n]}": float(state["step"]) for n, state in local.items()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, steps)
    for part in gathered:
        out.update({k: torch.tensor(v) for k, v in part.items()})
    return out


def _optimizer(model):
    """Megatron DDP + distributed optimizer (AdamW lr 1e-2, weight decay 0.01, no clipping) around `model`."""
    from moe.optimizer import OptimizerSettings, build_optimizer, wrap_data_parallel

    ddp = wrap_data_parallel(model)
    return ddp, build_optimizer(ddp, OptimizerSettings(lr=1e-2, weight_decay=0.01, clip_grad=0.0))


def _model(label: str, pipeline_parallel: int):
    from moe.model import build_model

    _, tie, overrides = next(v for v in VARIANTS if v[0] == label)
    layout = megatron_groups(pipeline_parallel=pipeline_parallel)
    return build_model(_arch(tie), layout, **(overrides if pipeline_parallel > 1 else {}))


def _pp2_body(rank, world_size, directory, seed):
    """The 2-rank PP=2 run shared by this file's tests (one spawn: ~6 s of start-up each on 2 cores): the
    gather / clipping checks' work, then the checkpoint save."""
    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng

    apply_cpu_shim()
    initialize_cpu_rng(seed)
    return {"gather": _gather_and_norm(seed, {}), "saved": _save_pp2(directory, seed)}


def _save_pp2(directory, seed):
    """PP=2: weights from full-model names, two distributed-optimizer steps on gradients from full-model names
    put straight into DDP's buffers (one data-parallel rank: nothing to reduce; the tied embedding's copy gets
    the embedding's, as after the embedding-group sum), then a sharded save of both.
    -> {variant: (full weights, full optimizer state, model_index)} as gathered at PP=2."""
    from moe import dist_checkpoint
    from moe.optimizer import optimizer_step
    from moe.parallel import destroy_model_parallel
    from moe.sharding import full_names, gather_full_state_dict, load_full_state_dict

    out = {}
    for label in CHECKPOINT_VARIANTS:
        model = _model(label, 2)
        names = full_names(model)
        params = dict(model.named_parameters())
        load_full_state_dict(model, {names[n]: _by_name("w." + names[n], p.shape, seed) for n, p in params.items()})
        ddp, opt = _optimizer(model)
        for step in range(2):
            grads = {names[n]: _by_name(f"g{step}." + names[n], p.shape, seed) for n, p in params.items()}
            pieces = _local_view(model, grads)
            ddp.zero_grad_buffer()
            for n, p in params.items():
                p.main_grad.copy_(pieces[n])
            optimizer_step(opt)
        dist_checkpoint.save_model(model, os.path.join(directory, label, "model"))
        dist_checkpoint.save_optimizer(model, opt, os.path.join(directory, label, "optimizer"))
        out[label] = (gather_full_state_dict(model), _adam_state(model, opt), dist_checkpoint.model_index(model))
        destroy_model_parallel()
    return out


def _load_body(rank, world_size, directory, labels, pipeline_parallel, resave_to=None):
    """A fresh model and distributed optimizer at `pipeline_parallel`, loaded from directory/<variant folder>; optionally
    saved again (PP=1 -> the reverse direction's input)."""
    from moe import dist_checkpoint
    from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
    from moe.parallel import destroy_model_parallel
    from moe.sharding import gather_full_state_dict

    apply_cpu_shim()
    initialize_cpu_rng(0)
    out = {}
    for label, folder in labels:
        model = _model(label, pipeline_parallel)
        _, opt = _optimizer(model)
        dist_checkpoint.load_model(model, os.path.join(directory, folder, "model"))
        changed = dist_checkpoint.load_optimizer(model, opt, os.path.join(directory, folder, "optimizer"))
        out[label] = (gather_full_state_dict(model), _adam_state(model, opt), changed)
        if resave_to:
            dist_checkpoint.save_model(model, os.path.join(resave_to, label, "model"))
            dist_checkpoint.save_optimizer(model, opt, os.path.join(resave_to, label, "optimizer"))
        destroy_model_parallel()
    return out


def _assert_identical(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), f"{where}: {sorted(set(got) ^ set(want))[:6]}"
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{where}: {key} differs"


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """-> (checkpoint folder, seed, per-rank results of `_pp2_body`)."""
    seed = fresh_seed()
    directory = str(tmp_path_factory.mktemp("pp2"))
    results = run_distributed(_pp2_body, world_size=2, timeout_s=240, args=(directory, seed))
    return directory, seed, results


@pytest.fixture(scope="module")
def pp2_checkpoint(pp2_run):
    directory, seed, results = pp2_run
    for label in CHECKPOINT_VARIANTS:  # every rank gathered the same full state, optimizer state and index
        (full0, adam0, index0), (full1, adam1, index1) = results[0]["saved"][label], results[1]["saved"][label]
        _assert_identical(full1, full0, f"seed {seed} {label} weights, rank 1 vs rank 0")
        _assert_identical(adam1, adam0, f"seed {seed} {label} optimizer state, rank 1 vs rank 0")
        assert index1 == index0
    return directory, seed, results[0]["saved"]


@pytest.mark.multiprocess
def test_pp2_checkpoint_loads_at_pp1_and_back_bit_for_bit(pp2_checkpoint, tmp_path):
    """Saved at PP=2 (untied and tied embeddings), loaded at PP=1 (1 process): weights, fp32 master weights,
    Adam moments and steps equal the PP=2 run's full gather bit for bit; saved again at PP=1 and loaded at PP=2 (even and
    uneven split), the same again."""
    directory, seed, saved = pp2_checkpoint
    labels = [(label, label) for label in CHECKPOINT_VARIANTS]
    loaded = run_distributed(_load_body, world_size=1, timeout_s=180,
                             args=(directory, labels, 1, str(tmp_path)))[0]
    for label in CHECKPOINT_VARIANTS:
        full, adam, _ = saved[label]
        got_full, got_adam, changed = loaded[label]
        assert len(adam) == 4 * len(full) and changed == []
        _assert_identical(got_full, full, f"seed {seed} {label} PP=2 -> PP=1 weights")
        _assert_identical(got_adam, adam, f"seed {seed} {label} PP=2 -> PP=1 optimizer state")
    back = [("even", "even"), ("uneven", "even"), ("tied", "tied")]
    reloaded = run_distributed(_load_body, world_size=2, timeout_s=180, args=(str(tmp_path), back, 2))
    for rank, by_label in enumerate(reloaded):
        for label, folder in back:
            full, adam, _ = saved[folder]
            got_full, got_adam, _ = by_label[label]
            _assert_identical(got_full, full, f"seed {seed} rank {rank} {label} PP=1 -> PP=2 weights")
            _assert_identical(got_adam, adam, f"seed {seed} rank {rank} {label} PP=1 -> PP=2 optimizer state")


def test_single_process_rebuilds_the_full_state_dict_of_a_pp2_checkpoint(pp2_checkpoint):
    from moe.dist_checkpoint import read_full_state_dict

    directory, seed, saved = pp2_checkpoint
    for label in CHECKPOINT_VARIANTS:
        full, _, index = saved[label]
        assert set(index) == set(full)
        rebuilt = read_full_state_dict(os.path.join(directory, label, "model"), index)
        _assert_identical(rebuilt, full, f"seed {seed} {label} rebuilt from the PP=2 folder")
