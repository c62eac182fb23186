"""The run: checks, then cold-start SFT, then RL steps, with checkpoints, metrics and evaluation around them.

    Trainer(cfg)   preflight (layout, data, tokenizer, architecture, model.init_from: megagspo.trainer.preflight)
                   -> process groups -> the run folder's lock -> resume point (megagspo.checkpoint)
                   -> policy (+ frozen KL reference), rollout engine, metrics files
    train()        held-out accuracy -> cold-start SFT (megagspo.trainer.sft) -> step_000000
                   -> RL steps: megagspo.trainer.rl_step (collect -> score -> prepare -> old_policy -> update
                      -> summarize), evaluation every rl.eval_every steps (megagspo.trainer.evaluation),
                      a checkpoint when due or on SIGTERM / SIGINT
                   -> summary.json, plots, checkpoint.pt

Tensor and pipeline parallelism: the TP x PP ranks of one data-parallel rank (its model-parallel group) get
the same prompts and the same rollouts (model-parallel rank 0 generates and broadcasts), sequences are
right-padded to a multiple of TP (sequence parallelism; the alignment padding is kept out of the router aux
loss), and metrics are summed over the data-parallel group only, so nothing is counted twice. Every pass
over micro-batches goes through `MegatronPolicy.run_micro_batches` (Megatron's 1F1B schedule when PP > 1).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from megagspo.checkpoint.state import RunParts, RunRng
from megagspo.config import Config, ConfigError
from megagspo.trainer.layout import world_from_env
from megagspo.trainer.preflight import preflight


class Trainer:
    def __init__(self, cfg: Config, *, quiet: bool = False) -> None:
        from megagspo.algorithm.registry import LossOptionError, build_loss
        from megagspo.data import build_datasets
        from megagspo.data.datasets import response_check_for
        from megagspo.rewards import get_reward
        from megagspo.rollout import get_engine_class

        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        # ---- everything that can be wrong with the input is checked before any compute ----
        try:
            # data.max_response_tokens limits the SFT demonstrations, or the answers a whole-answer reward compares
            self.tokenizer, train, held_out, self.data_stats = build_datasets(
                cfg.data, response_check=response_check_for(cfg.sft.steps, cfg.reward.name))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"data: {cfg.data.train_path or cfg.data.eval_path!r} (or data.eval_path) is not "
                              f"UTF-8 text ({exc})") from None
        checked = preflight(cfg, world_from_env(), self.tokenizer.vocab_size)
        self.dp, arch, init_source = checked.data_parallel, checked.arch, checked.init_source
        from megagspo.rewards.bounded import with_time_limit

        # a worker process killed at reward.timeout_s (C-level loops included); started at the first call
        self.reward_fn = with_time_limit(get_reward(cfg.reward.name), cfg.reward.timeout_s)
        try:  # every rl.* loss option through the loss registry (torch, or the fused kernel when asked)
            self.loss_fn, self.loss_cfg = build_loss(cfg.rl)
        except LossOptionError as exc:
            raise ConfigError(str(exc)) from None
        engine_cls = get_engine_class(cfg.rollout.engine)

        # ---- model, engine, optimizer ----
        from megagspo.trainer.policy import setup_parallel

        self.layout, self.rank, self.world = setup_parallel(cfg.parallel, cfg.seed)
        # ---- one owner per run folder, before anything in it is read for writing or moved ----
        from megagspo.checkpoint.run_lock import RunFolderBusy, RunFolderLock
        from megagspo.collective import run_on_rank0

        self.run_lock = RunFolderLock(cfg.run_dir(), f"megagspo {'train' if cfg.rl.steps else 'sft'}")
        run_on_rank0("taking the run folder", lambda: self.run_lock.acquire() and None, peer_error=RunFolderBusy)
        try:
            self._build_run(cfg, arch, train, held_out, init_source, engine_cls, quiet)
        except BaseException:
            self.run_lock.release()  # a start that failed leaves the folder free for the next attempt
            raise

    def _build_run(self, cfg: Config, arch, train, held_out, init_source, engine_cls, quiet: bool) -> None:
        """Everything after the run folder is owned: resume point, models, engine, run files, RNG."""
        from megagspo.checkpoint import CheckpointManager, StopRequest
        from megagspo.data import PromptDataset

        # the resume point is chosen, verified and checked against this model before anything in the run
        # folder is written (megagspo.checkpoint; docs/robustness.md)
        self.ckpt = CheckpointManager(cfg, self.rank, self.world)
        self.resume = self.ckpt.find_resume(arch, len(train))
        self.stop = StopRequest()
        self.arch = arch
        self._build_models(cfg, arch, init_source)
        # the embedded engine takes the policy's precision on a GPU (bf16 -> bf16), fp32 on the CPU (hf_engine)
        engine_kwargs = ({"config": cfg.rollout.sglang} if cfg.rollout.engine == "sglang"
                         else {"dtype": cfg.model.precision} if cfg.rollout.engine == "hf" else {})
        self.engine = engine_cls(arch, self.tokenizer, record_routes=cfg.rollout.record_routes, **engine_kwargs)
        self.sync_weights()
        self.train_ds = PromptDataset(train, seed=cfg.seed + 17)
        self.held_out = held_out
        self.dp_rank = self.policy.dp_rank
        self.is_main = self.rank == 0
        self.quiet = quiet or not self.is_main
        self._open_run_files(cfg)
        self.sample_gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.dp_rank)
        self.rng = RunRng(self.sample_gen)
        # Sampling randomness differs per data-parallel rank; the TP ranks of one DP rank draw the same
        # (rank == dp_rank without TP). Training rollouts are also broadcast from TP rank 0 (_generate).
        torch.manual_seed(cfg.seed * 7919 + self.dp_rank)
        self.summary: dict = {"data": self.data_stats, "device": str(self.policy.device),
                              "precision": cfg.model.precision}
        if self.resume:
            self.ckpt.restore_rng_and_data(self.checkpoint_parts(), self.resume)
        if self.is_main and self.logger.tb_note and not self.quiet:
            print(self.logger.tb_note)

    def _build_models(self, cfg: Config, arch, init_source) -> None:
        """The policy (weights from the resumed checkpoint, else model.init_from) and, at rl.kl_coef > 0, the
        frozen KL reference: a second Megatron model of the same layout, built before the RNG is reseeded so
        that building it changes no random draw of the run. Its weights are the policy's at the start of RL:
        copied by _start_reference (a fresh run, or a resume from step_000000, whose weights ARE the start of
        RL) or read back from <run>/reference.safetensors."""
        from megagspo.trainer.init_weights import load_init_weights
        from megagspo.trainer.policy import MegatronPolicy

        def policy(frozen: bool = False):
            return MegatronPolicy(arch, self.layout, cfg.parallel, cfg.rl.logprob_impl, frozen=frozen,
                                  precision=cfg.model.precision, logprob_path=cfg.model.logprob_path,
                                  logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
                                  implementation=cfg.model.implementation())

        self.policy = policy()
        if self.resume:
            self.ckpt.load_model(self.policy, self.resume)  # the engine gets these weights from sync_weights
        else:  # a resume's weights come from its checkpoint: model.init_from is not read again
            load_init_weights(self.policy, init_source, arch)
        self.optimizer = None  # the RL optimizer, made by run_rl (SFT has its own, freed after the cold start)
        self.reference = None
        self._reference_ready = False
        if cfg.rl.kl_coef > 0:
            self.reference = policy(frozen=True)
            if self.resume and self.resume["state"]["step"] > 0:
                self._resume_reference()

    def _open_run_files(self, cfg: Config) -> None:
        """Everything is checked: from here on the run folder is written. A fresh run first moves earlier
        checkpoints aside; metrics.jsonl (the rows up to a resumed checkpoint) and config.yaml are rewritten.
        Rank 0 writes; a failure (disk full, read-only) reaches every rank."""
        from megagspo.metrics_log import MetricsLogger

        self.ckpt.retire_previous()
        self.logger = MetricsLogger(cfg.run_dir(), enabled=False)

        def write():
            prior = self.ckpt.prior_metrics(self.resume, os.path.join(cfg.run_dir(), "metrics.jsonl")) \
                if self.resume else []
            self.logger = MetricsLogger(cfg.run_dir(), enabled=True, tensorboard=cfg.log.tensorboard)
            for row in prior:
                self.logger.log(row)
            self.logger.raise_write_error()
            import yaml

            with open(os.path.join(cfg.run_dir(), "config.yaml"), "w") as f:
                yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)

        self._from_rank0("writing metrics.jsonl and config.yaml", write)

    # ------------------------------------------------------------------------------------- KL reference
    def _start_reference(self) -> None:
        from megagspo.trainer.kl_reference import start_reference

        start_reference(self)

    def _resume_reference(self) -> None:
        from megagspo.trainer.kl_reference import resume_reference

        resume_reference(self)

    def checkpoint_parts(self) -> RunParts:
        """What a checkpoint holds of this run, by name (megagspo.checkpoint.state.RunParts)."""
        return RunParts(policy=self.policy, optimizer=self.optimizer, dataset=self.train_ds, rng=self.rng,
                        metrics=self.logger, summary=self.summary, arch=self.arch, data_parallel=self.dp,
                        data_parallel_rank=self.dp_rank)

    # ------------------------------------------------------------------------------------------- utils
    def _all_sum(self, values: list) -> list:
        from megagspo.collective import sum_over

        return sum_over(values, self.policy.dp_group)

    def sync_weights(self) -> float:
        """Stream the policy's weights to the rollout engine (collective: every rank calls it); returns seconds.

        The full (TP=EP=PP=1) model goes out in buckets of at most `rollout.sync_bucket_mib` MiB, gathered one
        bucket at a time over TP / EP / PP (moe.sharding.iter_full_state_buckets), so that no rank ever holds
        the whole model. Only the ranks
        whose engine needs the weights receive buckets (engine.weights_needed: for the embedded engine the
        ranks that generate, model-parallel rank 0 of each data-parallel rank, see _generate; for SGLang rank 0,
        which sends); the others relay their shards and iterate empty buckets."""
        from moe.sharding import iter_full_state_buckets

        t0 = time.perf_counter()
        generates = self.policy.mp_size == 1 or torch.distributed.get_rank(self.policy.mp_group) == 0
        bucket_bytes = self.cfg.rollout.sync_bucket_mib * 2**20
        buckets = iter_full_state_buckets(self.policy.model, bucket_bytes,
                                          receive=self.engine.weights_needed(generates))
        self.engine.update_weights_from_buckets(buckets)
        return time.perf_counter() - t0

    def _generate(self, prompts: list, n: int, sampling):
        """The rollout engine's samples; under TP / PP only rank 0 of each model-parallel group (the TP x PP
        ranks of one data-parallel rank) generates and broadcasts to its peers, so that they all train on the
        same rollouts."""
        if self.policy.mp_size == 1:
            return self.engine.generate(prompts, n, sampling)
        return self._from_mp_rank0("rollout generation", lambda: self.engine.generate(prompts, n, sampling))

    def _from_mp_rank0(self, what: str, fn):
        """fn() on model-parallel rank 0 only, its result broadcast to the TP x PP peers (see _from_rank0)."""
        return self._from_rank0(what, fn, self.policy.mp_group)

    def _from_rank0(self, what: str, fn, group=None):
        """fn() on rank 0 of `group` (None: every process) only, its result (or its error) reaching every
        rank of the group (megagspo.collective.run_on_rank0)."""
        from megagspo.collective import run_on_rank0

        return run_on_rank0(what, fn, group)

    def _seq_length(self, natural: int) -> int:
        """Model input length >= natural, a multiple of TP (sequence parallelism splits S over TP ranks)."""
        m = self.policy.seq_multiple
        return -(-natural // m) * m

    def _local_slice(self, items: list) -> list:
        n = len(items) // self.dp
        return items[self.dp_rank * n:(self.dp_rank + 1) * n]

    def _progress(self, total: int, desc: str):
        if self.quiet or not self.cfg.log.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, dynamic_ncols=True)

    # ---------------------------------------------------------------------------------------- evaluation
    def evaluate(self) -> dict:
        from megagspo.trainer.evaluation import evaluate

        return evaluate(self)

    # ----------------------------------------------------------------------------------------------- SFT
    def run_sft(self) -> dict:
        from megagspo.trainer.sft import run_sft

        return run_sft(self)

    # ------------------------------------------------------------------------------------------------ RL
    def rl_step(self, step: int) -> dict:
        """One rollout batch through the stages of megagspo.trainer.rl_step; its metrics row."""
        from megagspo.trainer.rl_step import rl_step

        return rl_step(self, step)

    def make_rl_optimizer(self):
        """Megatron's distributed optimizer (AdamW) for the RL updates (rl.lr, betas, weight decay, clip);
        its fp32 master weights start from the policy's weights now (after cold-start SFT / init / resume)."""
        from moe.optimizer import OptimizerSettings

        cfg = self.cfg.rl
        return self.policy.make_optimizer(OptimizerSettings(lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                            beta1=cfg.beta1, beta2=cfg.beta2, clip_grad=cfg.grad_clip))

    def run_rl(self, cold_start: dict, start_step: int = 0) -> dict:
        cfg = self.cfg.rl
        self.optimizer = self.make_rl_optimizer()
        if self.resume:
            self.ckpt.load_optimizer(self.policy, self.optimizer, self.resume)
        if self.reference is not None and not self._reference_ready:
            self._start_reference()
        bar = self._progress(cfg.steps, f"{cfg.loss.upper()} RL")
        last_eval = dict(cold_start)
        if bar is not None and start_step:
            bar.update(start_step)
        for step in range(start_step, cfg.steps):
            row = {"phase": "rl", "step": step}
            row.update(self.rl_step(step))
            fresh = (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1
            if fresh:
                t = time.perf_counter()
                last_eval = self.evaluate()
                row["time/eval_s"] = time.perf_counter() - t
            else:
                row["time/eval_s"] = 0.0
            row.update({k: v for k, v in last_eval.items() if k != "eval/count"})
            row["eval/fresh"] = 1.0 if fresh else 0.0
            self.logger.log(row)
            self._checkpoint_and_maybe_stop(step + 1, last_eval)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.3f}", acc=f"{row['eval/accuracy']:.3f}",
                                tok_s=f"{row['throughput/tokens_per_s']:.0f}")
        if bar is not None:
            bar.close()
        return last_eval

    # ------------------------------------------------------------------------------------------- drivers
    def _checkpoint_and_maybe_stop(self, steps_done: int, last_eval: dict) -> None:
        """After each RL step: a checkpoint when due or when SIGTERM/SIGINT arrived; then stop on the signal."""
        self._stop_if_metrics_unwritable()
        signum = self.stop.requested()
        if signum or self.ckpt.due(steps_done, self.cfg.rl.steps):
            path = self.ckpt.save(self.checkpoint_parts(), steps_done, last_eval)
        if signum:
            import signal as _signal

            name = _signal.Signals(signum).name
            raise self._preempted(f"stopped by {name} after RL step {steps_done}; checkpoint {path} written; "
                                  "continue with --resume (or checkpoint.resume=auto)", signum)

    def _stop_if_metrics_unwritable(self) -> None:
        """Collective: when rank 0 could not append to metrics.jsonl (disk full, ...), every rank stops here
        together, at a step boundary, instead of rank 0 exiting while its peers wait in a collective."""
        self._from_rank0("appending to metrics.jsonl", self.logger.raise_write_error)

    def _preempted(self, msg: str, signum: int):
        from megagspo.checkpoint import Preempted

        self.logger.close()
        return Preempted(msg, 128 + signum)

    def save_checkpoint(self, name: str = "checkpoint.pt") -> Optional[str]:
        """Collective: the full (TP=EP=PP=1) weights as <run>/<name> (weights-only torch file, atomic), for
        `megagspo export` and `model.init_from`; a failed write stops every rank together."""
        from megagspo.checkpoint.full_state import save_full_checkpoint

        state = self.policy.full_state_dict()  # collective under EP: every rank calls it
        path = os.path.join(self.cfg.run_dir(), name)
        self._from_rank0(f"writing {name}", lambda: save_full_checkpoint(
            path, state, self.arch, self.cfg.data.tokenizer, self.cfg.to_dict(), intact=self.ckpt.root))
        return path if self.is_main else None

    def train(self, rl: bool = True) -> dict:
        self.stop.install()
        try:
            return self._train(rl)
        finally:
            self.stop.uninstall()
            self.run_lock.release()
            getattr(self.reward_fn, "close", lambda: None)()  # the verifier's worker, if any

    def _train(self, rl: bool) -> dict:
        t0 = time.perf_counter()
        if self.resume and rl and self.cfg.rl.steps:
            return self._train_resumed(t0)
        base = self.evaluate()
        self.summary["init/accuracy"] = base["eval/accuracy"]
        self.summary.update(self.run_sft())
        self._stop_if_metrics_unwritable()
        if self.cfg.sft.steps and self.cfg.log.save_checkpoint and rl and self.cfg.rl.steps:
            self.save_checkpoint("cold_start.pt")  # megagspo train model.init_from=<run>/cold_start.pt sft.steps=0
        cold = self.evaluate()
        from megagspo.metrics_log import cold_start_line, eval_record, final_line

        self.summary.update(eval_record("cold_start", cold, self.cfg.rl.eval_samples))  # only what was measured
        self.logger.log({"phase": "cold_start", "step": 0, "eval/accuracy": cold["eval/accuracy"],
                         "init/accuracy": base["eval/accuracy"]})
        if rl and self.cfg.rl.steps:
            if self.reference is not None:  # written before step_000000: every RL checkpoint has its reference
                self._start_reference()
            self.ckpt.save(self.checkpoint_parts(), 0, cold, phase="cold_start")  # step_000000: SFT is never redone
            signum = self.stop.requested()
            if signum:
                raise self._preempted("stopped by a signal after cold-start SFT; checkpoint step_000000 written; "
                                      "continue with --resume", signum)
        self._say(cold_start_line(base, cold, self.cfg.sft.steps))
        if rl and self.cfg.rl.steps:
            t_rl = time.perf_counter()
            final = self.run_rl(cold)
            self.summary["rl/time_s"] = time.perf_counter() - t_rl
            self.summary.update(eval_record("final", final, self.cfg.rl.eval_samples))  # only what was measured
            self._say(final_line(final, cold, self.cfg.rl.steps, self.cfg.rl.loss, self.cfg.sft.steps,
                                 self.cfg.rl.eval_samples, self.cfg.rollout.temperature))
        return self._finish(t0)

    def _train_resumed(self, t0: float) -> dict:
        """Continue an RL run from self.resume (weights, RNG, data position already restored)."""
        state = self.resume["state"]
        self.summary.update(state.get("summary", {}))
        cold = dict(state["last_eval"])
        if state["step"] < self.cfg.rl.steps:
            t_rl = time.perf_counter()
            final = self.run_rl(cold, start_step=state["step"])
            self.summary["rl/time_s"] = self.summary.get("rl/time_s", 0.0) + time.perf_counter() - t_rl
        else:
            final = cold
        from megagspo.metrics_log import eval_record

        self.summary.update(eval_record("final", final, self.cfg.rl.eval_samples))  # only what was measured
        self._say(f"held-out accuracy after {self.cfg.rl.steps} {self.cfg.rl.loss} steps (resumed at step "
                  f"{state['step']}): greedy {final['eval/accuracy']:.3f}")
        return self._finish(t0)

    def _finish(self, t0: float) -> dict:
        if self.cfg.log.save_checkpoint:
            path = self.save_checkpoint()
            if path:
                self.summary["checkpoint"] = path
        self.summary["total_time_s"] = time.perf_counter() - t0
        if self.is_main:
            import json

            if self.cfg.log.plots:
                from megagspo.metrics_log import write_plots

                self.summary["plots"] = write_plots(
                    self.logger.rows, self.cfg.run_dir(), self.summary["cold_start/accuracy"], loss=self.cfg.rl.loss,
                    sampled_measured=bool(self.cfg.rl.eval_samples),
                    cold_start_label="cold start" if self.cfg.sft.steps else "before RL")
            with open(os.path.join(self.cfg.run_dir(), "summary.json"), "w") as f:
                json.dump(self.summary, f, indent=2)
            self._say(f"run folder: {self.cfg.run_dir()} (metrics.jsonl, summary.json, plots)")
        self.logger.close()
        return self.summary

    def _say(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)
