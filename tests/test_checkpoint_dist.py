"""Sharded checkpoints through Megatron-Core's dist_checkpointing (moe.dist_checkpoint), over gloo:

- at EP=2 each rank writes its own torch_dist shard file, and the metadata says rank 1's file holds exactly
  the experts rank 1 owns (2 and 3 of 4) while the replicated dense weights are written once, by rank 0;
- loaded at EP=1 (1 process), weights and the distributed optimizer's fp32 master weights, Adam moments and
  steps equal the EP=2 run's full gather bit for bit;
- one process with no process group rebuilds the full TP=EP=1 state dict from the shards;
- the pickled `.metadata` is read with an allow-list: a file carrying code is refused and the code never runs;
- the Megatron internals the in-process save relies on are checked and fail loudly when they change.

Marked gpu (tests/devices.py): the EP=1 load runs with the model and optimizer on CUDA (the CPU-written shards
copied into CUDA parameters and CUDA optimizer state), and a checkpoint saved from CUDA (EP=1, NCCL world of
one, two optimizer steps) loads on the CPU and on CUDA. Checkpoints hold copies: compared bit for bit on
every device, no tolerance.
"""

import io
import os
import pickle

import pytest
import torch

from devices import DEVICES, child_env, cuda_env
from multiprocess import run_distributed

OVERRIDES = ["data.train_size=200", "data.eval_size=20"]


def _policy(ep):
    from megagspo.config import load_config
    from megagspo.data import build_datasets
    from megagspo.policy.megatron_policy import MegatronPolicy, setup_parallel

    cfg = load_config("configs/tiny_cpu.yaml", [*OVERRIDES, f"parallel.expert_parallel={ep}"])
    tok, _, _, _ = build_datasets(cfg.data)
    dims, _, _ = setup_parallel(cfg.parallel, seed=3)
    return MegatronPolicy(cfg.model.architecture(tok.vocab_size), dims, cfg.parallel)


def _save_body(rank, world_size, directory):
    """EP=2: two distributed-optimizer steps on random gradients (different per rank, reduced by Megatron's
    DDP), then a sharded save."""
    from megagspo.checkpoint.state import gather_optimizer_state
    from moe import dist_checkpoint
    from moe.optimizer import OptimizerSettings

    policy = _policy(world_size)
    opt = policy.make_optimizer(OptimizerSettings(lr=1e-3, weight_decay=0.01))
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        policy.zero_grad()
        for p in policy.model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        policy.step(opt)
    dist_checkpoint.save_model(policy.model, os.path.join(directory, "model"))
    dist_checkpoint.save_optimizer(policy.model, opt, os.path.join(directory, "optimizer"))
    index = dist_checkpoint.model_index(policy.model)
    return policy.full_state_dict(), gather_optimizer_state(policy, opt), index


def _load_body(rank, world_size, directory):
    """EP=1 (1 process): load the EP=2 checkpoint into a fresh model and a fresh distributed optimizer."""
    from megagspo.checkpoint.state import gather_optimizer_state
    from moe import dist_checkpoint
    from moe.optimizer import OptimizerSettings

    policy = _policy(1)
    opt = policy.make_optimizer(OptimizerSettings(lr=0.5, weight_decay=0.2))
    dist_checkpoint.load_model(policy.model, os.path.join(directory, "model"))
    changed = dist_checkpoint.load_optimizer(policy.model, opt, os.path.join(directory, "optimizer"))
    decays = sorted({group["weight_decay"] for group in opt.param_groups})
    return policy.full_state_dict(), gather_optimizer_state(policy, opt), decays, changed


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dist"))
    results = run_distributed(_save_body, world_size=2, timeout_s=240, args=(directory,))
    full, opt_full, index = results[0]
    assert results[1][2] == index  # the index is the same on every rank
    return directory, full, opt_full, index


@pytest.mark.multiprocess
def test_each_rank_writes_its_own_shard_file(ep2_checkpoint):
    from moe.dist_checkpoint import read_metadata_safely

    directory, _, _, _ = ep2_checkpoint
    for part in ("model", "optimizer"):
        assert sorted(os.listdir(os.path.join(directory, part))) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    md = read_metadata_safely(os.path.join(directory, "model"))
    experts = "decoder.layers.0.mlp.experts.experts.linear_fc2.weight"  # global shape [4 experts, H, I]
    by_file = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((idx.fqn, tuple(idx.offset)))
    assert sorted((o[0] for k, o in by_file["__0_0.distcp"] if k == experts)) == [0, 1]
    assert sorted((o[0] for k, o in by_file["__1_0.distcp"] if k == experts)) == [2, 3]
    dense = {k for k, _ in by_file["__0_0.distcp"]} - {k for k, _ in by_file["__1_0.distcp"]}
    assert "embedding.word_embeddings.weight" in dense  # replicated over the 2 ranks: written once
    assert all(".experts." in k for k, _ in by_file["__1_0.distcp"])
    opt_md = read_metadata_safely(os.path.join(directory, "optimizer"))
    assert f"optimizer.state.exp_avg.{experts}" in opt_md.state_dict_metadata
    assert tuple(opt_md.state_dict_metadata[f"optimizer.state.exp_avg.{experts}"].size) == \
        tuple(md.state_dict_metadata[experts].size)


def _check_loaded(got_full, got_opt, full, opt_full):
    assert set(got_full) == set(full) and all(torch.equal(got_full[k], full[k]) for k in full)
    assert set(got_opt) == set(opt_full) and len(opt_full) == 4 * len(full)
    for key, value in opt_full.items():
        assert torch.equal(got_opt[key], value), key
    for name, weight in full.items():  # fp32 run: the master weights are the weights
        assert torch.equal(got_opt[f"master/{name}"], weight), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", DEVICES)
def test_ep2_checkpoint_loads_at_ep1_with_identical_weights_and_moments(ep2_checkpoint, device):
    directory, full, opt_full, _ = ep2_checkpoint
    got_full, got_opt, decays, changed = run_distributed(_load_body, world_size=1, timeout_s=240,
                                                         args=(directory,), env=child_env(device))[0]
    # the same exact comparisons on CUDA: a load copies the stored bytes (float32 in, float32 out)
    assert set(got_full) == set(full) and all(torch.equal(got_full[k], full[k]) for k in full)
    assert set(got_opt) == set(opt_full) and len(opt_full) == 4 * len(full)
    for key, value in opt_full.items():  # master / exp_avg / exp_avg_sq / step of every parameter, experts 2-3
        assert torch.equal(got_opt[key], value), key
    assert any(key.startswith("exp_avg/") and "local_experts.3." in key for key in opt_full)
    for name, weight in full.items():  # fp32 run: the master weights are the weights
        assert torch.equal(got_opt[f"master/{name}"], weight), name
    # Hyper-parameters stay the configured ones (a resumed run may change them on purpose); the change is
    # reported (once, whatever the param groups: dense and expert). The learning rate is the schedule's and never
    # reported.
    assert decays == [0.2]
    assert changed == ["weight_decay: 0.01 in the checkpoint -> 0.2 now"]


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_checkpoint_saved_from_cuda_loads_on_cpu_and_cuda_bit_for_bit(tmp_path):
    """dist_checkpointing's save of CUDA shards and of the distributed optimizer's CUDA state (EP=1, one GPU),
    loaded into a fresh CPU process and a fresh CUDA process: weights, masters, moments and steps exact."""
    directory = str(tmp_path)
    full, opt_full, index = run_distributed(_save_body, world_size=1, timeout_s=240, args=(directory,),
                                            env=cuda_env())[0]
    assert set(index) == set(full)
    assert any(key.startswith("exp_avg/") for key in opt_full)
    for env in (None, cuda_env()):
        got_full, got_opt, decays, changed = run_distributed(_load_body, world_size=1, timeout_s=240,
                                                             args=(directory,), env=env)[0]
        _check_loaded(got_full, got_opt, full, opt_full)
        assert decays == [0.2] and changed == ["weight_decay: 0.01 in the checkpoint -> 0.2 now"]
    from moe.dist_checkpoint import read_full_state_dict

    rebuilt = read_full_state_dict(os.path.join(directory, "model"), index)
    assert set(rebuilt) == set(full) and all(torch.equal(rebuilt[k], full[k]) for k in full)


def test_single_process_rebuilds_the_full_state_dict(ep2_checkpoint):
    from moe.dist_checkpoint import read_full_state_dict

    directory, full, _, index = ep2_checkpoint
    assert set(index) == set(full)
    rebuilt = read_full_state_dict(os.path.join(directory, "model"), index)
    assert set(rebuilt) == set(full) and all(torch.equal(rebuilt[k], full[k]) for k in full)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_metadata_carrying_code_is_refused(tmp_path, ep2_checkpoint):
    import shutil

    from moe.dist_checkpoint import DistCheckpointError, check_folder, read_full_state_dict

    directory, _, _, index = ep2_checkpoint
    bad = tmp_path / "model"
    shutil.copytree(os.path.join(directory, "model"), bad)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    pickle.dump({"x": _Evil(str(marker))}, buf)
    (bad / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(DistCheckpointError, match="refusing to unpickle io.open"):
        check_folder(str(bad))
    with pytest.raises(DistCheckpointError, match="refusing to unpickle"):
        read_full_state_dict(str(bad), index)
    assert not marker.exists()


def test_missing_shard_file_is_named(tmp_path, ep2_checkpoint):
    import shutil

    from moe.dist_checkpoint import DistCheckpointError, check_folder

    directory, _, _, _ = ep2_checkpoint
    bad = tmp_path / "model"
    shutil.copytree(os.path.join(directory, "model"), bad)
    os.remove(bad / "__1_0.distcp")
    with pytest.raises(DistCheckpointError, match="__1_0.distcp: shard file named by .metadata is missing"):
        check_folder(str(bad))


def test_save_internals_are_checked(monkeypatch):
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    from moe.dist_checkpoint import DistCheckpointError, verify_save_internals

    verify_save_internals()

    def _get_write_results_queue(ctx):  # an "upgraded" Megatron gained a parameter
        return None

    monkeypatch.setattr(filesystem_async, "_get_write_results_queue", _get_write_results_queue)
    with pytest.raises(DistCheckpointError, match="_get_write_results_queue is missing or changed"):
        verify_save_internals()


def _save_fails_body(rank, world_size, directory):
    """A write error inside Megatron's save (a full disk) surfaces as one of moe.dist_checkpoint's documented
    save errors on every rank (torch re-raises it as CheckpointException, a BaseException)."""
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from moe import dist_checkpoint

    policy = _policy(world_size)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    filesystem_async._write_item = no_space
    try:
        dist_checkpoint.save_model(policy.model, os.path.join(directory, "model"))
    except (OSError, dist_checkpoint.DistCheckpointError, *dist_checkpoint.save_errors()) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.multiprocess
def test_a_failed_shard_write_is_a_catchable_save_error(tmp_path):
    outcome = run_distributed(_save_fails_body, world_size=1, timeout_s=240, args=(str(tmp_path),))[0]
    assert outcome != "no error" and "No space left on device" in outcome, outcome


def test_implementation_switches_are_not_reported_as_changed_hyper_parameters():
    """A checkpoint written by the CPU's AdamW (fused None) resumed on a GPU, where moe.optimizer builds torch's
    fused AdamW: the optimizer's hyper-parameters are the same, and only real changes are reported (the CUDA
    resume test reported 'fused: None in the checkpoint -> True now' before)."""
    from moe.dist_checkpoint import _changed_hyper_parameters

    saved = [{"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "fused": None, "foreach": None},
             {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.999), "fused": None, "foreach": None}]
    live = [dict(g, fused=True, foreach=False) for g in saved]
    assert _changed_hyper_parameters(saved, live) == []
    live[0]["weight_decay"] = 0.2
    assert _changed_hyper_parameters(saved, live) == ["weight_decay: [0.0, 0.01] in the checkpoint -> [0.0, 0.2] now"]
