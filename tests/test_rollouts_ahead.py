"""One-step-off asynchronous rollouts (rollout.staleness = 1, rollout.producer = thread; megagspo.rl.rollouts_ahead;
the resume test runs the default, the producer process of megagspo.rl.producer): each RL batch is
generated on the background thread from exactly the weights one update old (an engine that counts its weight
updates records the version each generate call saw), staleness 0 is the synchronous order, the configuration
refuses what it cannot run, and a run killed mid-way and resumed logs the metrics of the uninterrupted one."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from multiprocess import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["sft.steps=2", "sft.batch_size=8", "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=2",
       "rl.mini_batches=1", "rl.eval_every=100", "rl.eval_samples=0", "data.train_size=60", "data.eval_size=4",
       "threads=1", "log.progress=false", "log.plots=false", "log.tensorboard=false", "log.save_checkpoint=false",
       "checkpoint.every_steps=0", "rollout.engine=hf_versioned", "rollout.producer=thread"]


def _versions_body(rank, world_size, out_dir, staleness):
    from megagspo.config import load_config
    from megagspo.rollout import get_engine_class, register_engine
    from megagspo.trainer.trainer import Trainer

    calls = []

    @register_engine("hf_versioned")
    class VersionedEngine(get_engine_class("hf")):
        """The embedded engine, counting its weight updates and recording what each generate call saw."""
        version = 0

        def update_weights_from_buckets(self, buckets):
            super().update_weights_from_buckets(buckets)
            type(self).version += 1

        def generate(self, prompts, n, sampling, switch=None):
            calls.append((threading.current_thread().name, n, type(self).version))
            return super().generate(prompts, n, sampling, switch=switch)

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                      RUN + [f"log.out_dir={out_dir}", f"name=s{staleness}", f"rollout.staleness={staleness}"])
    trainer = Trainer(cfg, quiet=True)
    trainer.train()
    return calls


def test_each_batch_comes_from_the_weights_one_update_old(tmp_path):
    """(The synchronous order, batch n from the weights after update n - 1, is the SGLang test's staleness 0.)"""
    calls = run_distributed(_versions_body, world_size=1, args=(str(tmp_path), 1), timeout_s=300)[0]
    rl = [(thread, version) for thread, n, version in calls if n == 2]  # the RL batches (evaluation: n = 1)
    assert len(rl) == 4
    first = rl[0][1]  # the weights at the start of RL: batch 0 is generated with them, now
    # batch n + 1 is generated during step n, on the background thread, with the weights after update n - 1
    assert [v for _, v in rl] == [first, first, first + 1, first + 2]
    assert [t for t, _ in rl] == ["MainThread"] + ["megagspo-rollouts-ahead"] * 3


@pytest.mark.parametrize("overrides, words", [
    (["rollout.staleness=-1"], ["rollout.staleness must be an integer >= 0"]),
    (["rollout.staleness=2", "rollout.producer=thread"], ["rollout.producer = thread", "not supported"]),
    (["rollout.staleness=1", "rollout.producer=thread", "rl.filter_groups=true"], ["rl.filter.enabled", "not supported"]),
    (["rollout.staleness=1", "rollout.producer=thread", "parallel.tensor_parallel=2"],
     ["tensor_parallel", "pipeline_parallel = 1"]),
])
def test_what_one_step_off_cannot_run_is_refused(overrides, words):
    """Refused by the config (a key's own range) or by the preflight the trainer and the dry run share (what
    combines with what: megagspo.rl.sources.source_class)."""
    from megagspo.config import ConfigError, load_config
    from megagspo.trainer.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), overrides), world=2, vocab_size=0)
    for w in words:
        assert w in str(err.value), str(err.value)


STALE_ARGS = ["rollout.staleness=1", "checkpoint.every_steps=1", "rl.steps=4", "rl.eval_every=4",
              "rl.eval_samples=0"]


@pytest.mark.slow
def test_one_step_off_run_killed_and_resumed_equals_uninterrupted(tmp_path):
    from helpers import CliRuns
    from test_checkpoint_resume import _assert_same_metrics, _cmd, _env, _rows, _served, _start_and_wait

    cli = CliRuns(_env(), str(tmp_path / "cli.log"))  # the runs only read afterwards; the killed one has its own
    try:
        _served(cli, _cmd(tmp_path, "ref", *STALE_ARGS))
        rl = [r for r in _rows(tmp_path / "ref") if r["phase"] == "rl"]
        assert len(rl) == 4 and rl[1]["mismatch/abs_log_ratio"] > rl[0]["mismatch/abs_log_ratio"]  # one update old
        proc = _start_and_wait(_cmd(tmp_path, "k", *STALE_ARGS), tmp_path / "k", min_rl_rows=2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        out = _served(cli, _cmd(tmp_path, "k", *STALE_ARGS, "--resume"))
        assert "resuming from" in out.stdout
        _assert_same_metrics(tmp_path / "ref", tmp_path / "k")
    finally:
        cli.close()


def test_seeded_sampling_is_reproducible_draws_nothing_global_and_follows_the_warpers(monkeypatch):
    """The engine's own generator (SamplingParams.generator): the same seed gives the same rollouts whatever the
    global generator does meanwhile; another seed others; at a near-zero temperature it picks what greedy picks
    (the temperature warper is applied before the Gumbel-max draw); log-probs stay the temperature-1 ones."""
    import dataclasses

    import torch
    from test_rollout_engine_memory import HFRolloutEngine, _arch, _Tok

    from megagspo.rollout import SamplingParams

    monkeypatch.setenv("MEGAGSPO_DEVICE", "cpu")
    torch.manual_seed(0)
    engine = HFRolloutEngine(_arch(40), _Tok())
    prompts = [[5, 6, 7], [8, 9]]
    base = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9)

    def run(seed, sampling=base, global_seed=0):
        torch.manual_seed(global_seed)
        return engine.generate(prompts, 3, dataclasses.replace(sampling, generator=engine.seeded_generator(seed)))

    a, b, c = run(1), run(1, global_seed=99), run(2)
    assert torch.equal(a.response_ids_RL, b.response_ids_RL) and torch.equal(a.logp_RL, b.logp_RL)
    assert not torch.equal(a.response_ids_RL, c.response_ids_RL)
    cold = run(1, dataclasses.replace(base, temperature=1e-4, top_p=1.0))
    greedy = engine.generate(prompts, 3, SamplingParams(max_new_tokens=10, greedy=True))
    assert torch.equal(cold.response_ids_RL, greedy.response_ids_RL)
    assert torch.equal(cold.logp_RL, greedy.logp_RL)


def _sglang_body(rank, world_size, url, out_dir, staleness):
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), [
        "sft.steps=0", "rl.steps=3", "rl.prompts_per_step=2", "rl.group_size=2", "rl.mini_batches=1",
        "rl.eval_every=100", "rl.eval_samples=0", "data.train_size=20", "data.eval_size=3", "threads=1",
        "log.progress=false", "log.plots=false", "log.tensorboard=false", "log.save_checkpoint=false",
        "checkpoint.every_steps=0", "rollout.engine=sglang", f"rollout.staleness={staleness}",
        f"log.out_dir={out_dir}", f"name=s{staleness}",
        "rollout.sglang={urls: [" + url + "], sync_dir: " + out_dir + "/sync}"])
    Trainer(cfg, quiet=True).train()
    return True


@pytest.mark.parametrize("staleness", [0, 1])
def test_sglang_batches_come_from_the_weights_one_update_old(tmp_path, staleness):
    """The SGLang engine against its test double (tests/test_sglang_engine.py's fake server): the order of the
    server's /generate requests (4 rows: an RL batch; 3: the held-out set) and weight updates."""
    from test_sglang_engine import FakeSGLang

    fake = FakeSGLang()
    try:
        run_distributed(_sglang_body, world_size=1, args=(fake.url, str(tmp_path), staleness), timeout_s=300)
        events = []
        for method, path, body in fake.requests:
            if method == "POST" and path == "/generate":
                events.append("rl" if len(body["input_ids"]) == 4 else "eval")
            elif method == "POST" and path.startswith("/update_weights"):
                events.append("sync")
    finally:
        fake.close()
    order = [e for e in events if e != "eval"]  # the held-out evaluations (before and after RL) left out
    if staleness == 0:  # the sync at start, then per step: its batch, the update's sync
        assert order == ["sync", "rl", "sync", "rl", "sync", "rl", "sync"], events
    else:  # batch n + 1 is requested before update n's weights reach the server
        assert order == ["sync", "rl", "rl", "sync", "rl", "sync", "sync"], events
