"""Checkpoints of a tensor-parallel run (issue "Checkpoints that never lose a run": "resuming with a different
parallel layout works", "a resumed CPU run reproduces the uninterrupted run's metrics exactly"), with real
trainers on 2 gloo ranks at parallel.tensor_parallel=2 (sequence parallelism on, Megatron's distributed optimizer):

- the shards are TP shards: each rank's .distcp file holds its half of a column-parallel weight (rows), of a
  row-parallel weight (columns) and of the vocab-parallel LM head, and the optimizer's master weights and moments are split the same way;
- one process with no process group (`load_run_checkpoint`, i.e. `megagspo export` / `model.init_from`)
  rebuilds the full weights, and `read_full_state_dict` the full moments, equal to the run's TP gather bit
  for bit (SwiGLU fc1 included: TP splits gate and up separately);
- the checkpoint resumes at TP=1 (1 process) and at TP=2: weights and optimizer state (masters, moments, steps) after loading
  equal the saved ones exactly;
- a TP=2 run stopped after step 2 (SIGTERM on one rank: finish the step, checkpoint, exit 143) and resumed
  with checkpoint.resume=auto logs exactly the uninterrupted run's metrics and ends with its weights.
"""

import json
import os
import signal

import pytest
import torch

from multiprocess import run_distributed
from test_checkpoint_resume import ARGS, _assert_same_metrics, _rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the resume tests' tiny run (minus `--config FILE`) with 4 RL steps at TP=2 on 2 ranks, a checkpoint every 2
# (step_000000 after SFT, step_000002, step_000004)
TP2 = [*ARGS[2:], "rl.steps=4", "checkpoint.every_steps=2", "parallel.tensor_parallel=2"]
DATA = ["data.train_size=200", "data.eval_size=20"]


def _trainer_body(rank, world_size, out_dir, name, overrides, stop_after):
    """A `megagspo train` run in this gloo rank. stop_after: SIGTERM (as the handler records it) reaches the
    last rank during RL step `stop_after` - 1. -> (exit code, full weights, full optimizer state, local shapes, the
    step the run resumed at or None)."""
    from megagspo.checkpoint import Preempted
    from megagspo.checkpoint.state import gather_optimizer_state
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                      [*overrides, f"log.out_dir={out_dir}", f"name={name}"])
    trainer = Trainer(cfg, quiet=True)
    assert trainer.dims.tp_size * trainer.dims.pp_size == world_size and trainer.dims.dp_size == 1
    if stop_after:
        rl_step = trainer.rl_step

        def rl_step_then_signal(step):
            row = rl_step(step)
            if step + 1 == stop_after and rank == world_size - 1:
                trainer.stop.signum = signal.SIGTERM  # one rank only: the flag is OR-reduced at the step end
            return row

        trainer.rl_step = rl_step_then_signal
    code = 0
    try:
        trainer.train()
    except Preempted as exc:
        code = exc.exit_code
    shapes = {n: tuple(p.shape) for n, p in trainer.policy.model.named_parameters()}
    resumed_at = trainer.resume["state"]["step"] if trainer.resume else None
    return (code, trainer.policy.full_state_dict(), gather_optimizer_state(trainer.policy, trainer.optimizer), shapes,
            resumed_at)


def _reload_body(rank, world_size, ckpt_dir, overrides):
    """A fresh policy and distributed optimizer at the layout of `overrides` load the checkpoint the way resume does.
    -> (full weights, full optimizer state, local shapes)."""
    from megagspo.checkpoint.state import CheckpointManager, gather_optimizer_state
    from megagspo.config import load_config
    from megagspo.data import build_datasets
    from megagspo.policy.megatron_policy import MegatronPolicy, setup_parallel
    from moe.optimizer import OptimizerSettings

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), overrides)
    tok, _, _, _ = build_datasets(cfg.data)
    dims, _, _ = setup_parallel(cfg.parallel, seed=3)  # another seed: the initial weights differ
    policy = MegatronPolicy(cfg.model.architecture(tok.vocab_size), dims, cfg.parallel)
    assert policy.dims.tp_size * policy.dims.pp_size == world_size
    assert (policy.dims.tp_size, policy.dims.pp_size) == (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel)
    opt = policy.make_optimizer(OptimizerSettings(lr=0.5, weight_decay=0.5))
    mgr = CheckpointManager(cfg, dims)
    point = {"path": ckpt_dir, "state": json.load(open(os.path.join(ckpt_dir, "trainer_state.json")))}
    mgr.load_model(policy, point)
    mgr.load_optimizer(policy, opt, point)
    shapes = {n: tuple(p.shape) for n, p in policy.model.named_parameters()}
    return policy.full_state_dict(), gather_optimizer_state(policy, opt), shapes


def _assert_equal(got: dict, expected: dict, what: str):
    assert set(got) == set(expected), f"{what}: keys differ {sorted(set(got) ^ set(expected))[:6]}"
    for key, value in expected.items():
        assert got[key].shape == value.shape and torch.equal(got[key], value), f"{what}: {key} differs"


def uninterrupted_run(out, overrides):
    """A 2-rank run of `overrides` (4 RL steps, a checkpoint every 2) to the end. -> (run folder, full weights,
    full optimizer state, each rank's local parameter shapes); both ranks gather the same full state."""
    reports = run_distributed(_trainer_body, world_size=2, timeout_s=300, args=(str(out), "ref", overrides, 0))
    (code, full, opt_full, shapes, resumed_at), other = reports
    assert code == 0 and other[0] == 0 and resumed_at is None
    _assert_equal(other[1], full, "rank 1's gathered weights")
    _assert_equal(other[2], opt_full, "rank 1's gathered optimizer state")
    assert sorted(os.listdir(out / "ref" / "checkpoints")) == ["step_000000", "step_000002", "step_000004"]
    return out / "ref", full, opt_full, (shapes, other[3])


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """The uninterrupted TP=2 run: 4 RL steps, its run folder, and (both ranks) its final gathered state."""
    run_dir, full, opt_full, (shapes, _) = uninterrupted_run(tmp_path_factory.mktemp("tp2"), TP2)
    return run_dir, full, opt_full, shapes


@pytest.mark.multiprocess
def test_tp2_shards_hold_halves_and_one_process_rebuilds_the_full_state(tp2_run):
    from megagspo.checkpoint import load_run_checkpoint
    from megagspo.checkpoint.full_state import load_checkpoint
    from moe.dist_checkpoint import read_full_state_dict, read_metadata_safely

    run_dir, full, opt_full, shapes = tp2_run
    ckpt = run_dir / "checkpoints" / "step_000004"
    state = json.load(open(ckpt / "trainer_state.json"))
    assert state["world"] == 2 and state["layout"]["tensor_parallel"] == 2 and state["optimizer"]
    for part in ("model", "optimizer"):  # each TP rank writes its own shard file
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(ckpt / part))

    # (key, local shape, split dim): column-parallel (rows), row-parallel (columns), vocab-parallel head
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    head = "output_layer.weight"
    for part, prefix in (("model", ""), ("optimizer", "optimizer.state.exp_avg."),
                         ("optimizer", "optimizer.state.exp_avg_sq.")):
        md = read_metadata_safely(str(ckpt / part))
        chunks = {}
        for idx, info in md.storage_data.items():
            chunks.setdefault(idx.fqn, []).append((info.relative_path, tuple(idx.offset)))
        for name, dim in ((qkv, 0), (proj, 1), (head, 0)):
            key = prefix + name
            global_shape = tuple(md.state_dict_metadata[key].size)
            assert global_shape == tuple(full[name].shape), key
            local = shapes[name]
            assert local[dim] * 2 == global_shape[dim] and local[1 - dim] == global_shape[1 - dim], (key, local)
            half = [0, 0]
            half[dim] = local[dim]
            assert sorted(chunks[key]) == [("__0_0.distcp", (0, 0)), ("__1_0.distcp", tuple(half))], chunks[key]

    # one process, no process group: the full weights and moments, as the TP=2 run gathered them
    rebuilt = load_run_checkpoint(str(ckpt))
    _assert_equal(rebuilt["state"], full, "load_run_checkpoint")
    assert rebuilt["path"] == str(ckpt)
    _assert_equal(load_checkpoint(str(run_dir))["state"], full, "load_checkpoint(run folder)")
    for kind in ("exp_avg", "exp_avg_sq"):
        index = {n: {"key": f"optimizer.state.{kind}.{w['key']}", "offset": w["offset"]}
                 for n, w in state["model_index"].items()}
        stored = read_full_state_dict(str(ckpt / "optimizer"), index)
        _assert_equal({f"{kind}/{n}": t for n, t in stored.items()},
                      {k: v for k, v in opt_full.items() if k.startswith(f"{kind}/")}, f"stored {kind}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1_one_process", "tp2"])
def test_tp2_checkpoint_resumes_with_identical_weights_and_moments(tp2_run, tp):
    run_dir, full, opt_full, saved_shapes = tp2_run
    ckpt = str(run_dir / "checkpoints" / "step_000004")
    reports = run_distributed(_reload_body, world_size=tp, timeout_s=240,
                              args=(ckpt, [*DATA, f"parallel.tensor_parallel={tp}"]))
    assert len(opt_full) == 4 * len(full)  # fp32 master, exp_avg, exp_avg_sq and step of every parameter
    assert all(bool(v.any()) for k, v in opt_full.items() if k.startswith("exp_avg_sq/"))  # every moment is live
    for rank, (got_full, got_opt, shapes) in enumerate(reports):
        if tp == 1:
            assert shapes == {n: tuple(t.shape) for n, t in full.items()}
        else:
            assert shapes == saved_shapes
        _assert_equal(got_full, full, f"TP={tp} rank {rank} weights")
        _assert_equal(got_opt, opt_full, f"TP={tp} rank {rank} optimizer state")


def stopped_and_resumed_equals_uninterrupted(ref_dir, full, opt_full, tmp_path, overrides):
    """A 2-rank run of `overrides` (4 RL steps, a checkpoint every 2) stopped by SIGTERM after RL step 2, then
    resumed with checkpoint.resume=auto, logs the uninterrupted run's metrics and ends with its state."""
    stopped = run_distributed(_trainer_body, world_size=2, timeout_s=300, args=(str(tmp_path), "res", overrides, 2))
    assert [r[0] for r in stopped] == [143, 143]  # the step finished, a checkpoint was written, exit 128 + 15
    run_dir = tmp_path / "res"
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_000000", "step_000002"]
    assert [r["step"] for r in _rows(run_dir) if r["phase"] == "rl"] == [0, 1]
    resumed = run_distributed(_trainer_body, world_size=2, timeout_s=300,
                              args=(str(tmp_path), "res", [*overrides, "checkpoint.resume=auto"], 0))
    # resumed from step_000002, not started over (a fresh CPU run would log the same metrics too)
    assert [(r[0], r[4]) for r in resumed] == [(0, 2), (0, 2)]
    _assert_same_metrics(ref_dir, run_dir)
    for rank, (_, got_full, got_opt, _, _) in enumerate(resumed):
        _assert_equal(got_full, full, f"resumed rank {rank} final weights")
        _assert_equal(got_opt, opt_full, f"resumed rank {rank} final optimizer state")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_run_stopped_and_resumed_equals_uninterrupted(tp2_run, tmp_path):
    ref_dir, full, opt_full, _ = tp2_run
    stopped_and_resumed_equals_uninterrupted(ref_dir, full, opt_full, tmp_path, TP2)


def _resume_into_tp2_body(rank, world_size, out_dir, name, overrides):
    """Resume a 1-process checkpoint on 2 ranks at TP=2 (another layout: RNG states are reseeded). -> (the
    mini-batch shuffle generator's state right after resuming, the step resumed at, exit code of the rest)."""
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                      [*overrides, f"log.out_dir={out_dir}", f"name={name}"])
    trainer = Trainer(cfg, quiet=True)
    gen_state = trainer.sample_gen.get_state().clone()
    resumed_at = trainer.resume["state"]["step"] if trainer.resume else None
    trainer.train()
    return gen_state, resumed_at


@pytest.mark.multiprocess
def test_resuming_another_layout_at_tp2_gives_tp_peers_the_same_minibatch_shuffle(tmp_path):
    """TP peers hold chunks of the same rows (sequence parallelism): after a cross-layout resume, which reseeds
    the RNG, both must draw the same mini-batch permutation — seeded by data-parallel rank, not process rank."""
    tp1 = [*ARGS[2:], "rl.steps=2", "checkpoint.every_steps=2"]
    (code, *_rest), = run_distributed(_trainer_body, world_size=1, timeout_s=300, args=(str(tmp_path), "x", tp1, 0))
    assert code == 0
    reports = run_distributed(_resume_into_tp2_body, world_size=2, timeout_s=300,
                              args=(str(tmp_path), "x", [*ARGS[2:], "rl.steps=3", "checkpoint.every_steps=2",
                                                         "parallel.tensor_parallel=2", "checkpoint.resume=auto"]))
    (gen0, at0), (gen1, at1) = reports
    assert at0 == at1 == 2
    assert torch.equal(gen0, gen1), "TP peers reseeded their mini-batch shuffle differently"
