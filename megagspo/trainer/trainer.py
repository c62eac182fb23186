"""The run, as the composition root: it checks the inputs, builds the parts, runs the loop, and owns
checkpoints and preemption. The parts never see it: each is built from explicit inputs.

    Trainer(cfg)   preflight (layout, data, tokenizer, architecture, model.init_from: megagspo.trainer.preflight)
                   -> process groups (ParallelDims, moe.parallel) -> the run folder's lock -> resume point
                   -> policy (+ KLReference: models), rollout engine (engine_link), metrics files (run_files)
                   -> Evaluator, ColdStartSFT, RLStep (megagspo.trainer.evaluation / sft, megagspo.rl.step)
    train()        held-out accuracy -> cold-start SFT -> step_000000
                   -> RL steps (collect -> score -> prepare -> old_policy -> update -> summarize), evaluation
                      every rl.eval.every steps (step_rows), a checkpoint when due or on SIGTERM / SIGINT
                   -> summary.json, plots, checkpoint.pt

Tensor and pipeline parallelism: the TP x PP ranks of one data-parallel rank (its model-parallel group) get
the same prompts and the same rollouts (model-parallel rank 0 generates and broadcasts), sequences are
right-padded to a multiple of TP (sequence parallelism; the alignment padding is kept out of the router aux
loss), and metrics are summed over the data-parallel group only, so nothing is counted twice. Every pass
over micro-batches goes through `MegatronPolicy.run_micro_batches` (Megatron's 1F1B schedule when PP > 1).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Optional

import torch

from megagspo import interrupts
from megagspo.checkpoint import CheckpointManager, Preempted, StopRequest
from megagspo.checkpoint.full_state import save_full_weights
from megagspo.checkpoint.run_folder import check_resume_reaches, start_over_hint
from megagspo.checkpoint.run_lock import RunFolderBusy, RunFolderLock
from megagspo.checkpoint.parts import CheckpointParts, DictState, PerRank, Shared
from megagspo.checkpoint.state import RNG, RunParts, RunRng
from megagspo.config import Config
from megagspo.data import PromptDataset
from megagspo.metrics_log import cold_start_line, eval_record, final_line, timeouts_note
from megagspo.policy.engine_link import EngineLink, build_engine, engine_kwargs
from megagspo.policy.megatron_policy import setup_parallel
from megagspo.policy.models import build_models, optimizer_settings
from megagspo.rl.producer import EngineRecipe, RewardRecipe
from megagspo.rl.sources import build_rollout_source
from megagspo.rl.step import RLStep
from megagspo.rollout import SamplingParams
from megagspo.trainer.console import Console
from megagspo.trainer.evaluation import Evaluator
from megagspo.trainer.hooks import RunHooks
from megagspo.trainer.run_files import open_run_files, write_summary
from megagspo.trainer.run_inputs import RunInputs, read_run_inputs
from megagspo.trainer.sft import ColdStartSFT
from megagspo.trainer.step_rows import StepRows, bar_postfix


class Trainer:
    def __init__(self, cfg: Config, *, quiet: bool = False, reward_fn: Optional[Callable] = None,
                 adamw_class: Optional[type] = None) -> None:
        """reward_fn: (response, answer) -> [0, 1] in place of reward.name's verifier; adamw_class: the torch
        optimizer inside Megatron's distributed optimizer (moe.optimizer.build_optimizer). Tests inject both."""
        self.adamw_class = adamw_class
        self.injected_reward = reward_fn  # a rollout producer process rebuilds reward.name's verifier, or takes this
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        # everything that can be wrong with the input is checked before any compute
        inputs = read_run_inputs(cfg, reward_fn)
        self.tokenizer, self.reward_fn, self.data_stats = inputs.tokenizer, inputs.reward_fn, inputs.data_stats
        self.agent = inputs.agent  # rollout.agent's multi-turn trajectories, or None
        # the run's one description of its process layout: sizes, ranks, groups and the step's collectives
        self.dims, _, _ = setup_parallel(cfg.parallel, cfg.seed)
        # ---- one owner per run folder, before anything in it is read for writing or moved ----
        self.run_lock = RunFolderLock(cfg.run_dir(), f"megagspo {'train' if cfg.rl.steps else 'sft'}")
        self.dims.on_rank0("taking the run folder", lambda: self.run_lock.acquire() and None, peer_error=RunFolderBusy)
        self.stop = StopRequest()
        try:
            self._build_run(cfg, inputs, quiet)
        except BaseException:
            self.stop.uninstall()  # the CLI's start-up guard again (or nothing was installed)
            self.run_lock.release()  # a start that failed leaves the folder free for the next attempt
            raise

    def _build_run(self, cfg: Config, inputs: RunInputs, quiet: bool) -> None:
        """Everything after the run folder is owned: resume point, models, engine, run files, RNG, the parts."""
        # the resume point is chosen, verified and checked against this model before anything in the run
        # folder is written (megagspo.checkpoint; docs/robustness.md)
        arch = self.arch = inputs.checked.arch
        self.ckpt = CheckpointManager(cfg, self.dims)
        self.resume = self.ckpt.find_resume(arch, len(inputs.train))
        if self.resume:  # the same answer on every rank: every rank refuses together
            check_resume_reaches(self.resume, cfg.rl.steps)
        self.checkpointed = bool(self.resume)  # this run has a checkpoint to continue from (a stop names the way on)
        # the policy, and the frozen KL reference (rl.kl.coef > 0) before the RNG is reseeded (models.py)
        self.policy, self.reference = build_models(cfg, arch, self.dims, self.ckpt, self.resume,
                                                   inputs.checked.init_source, self.adamw_class)
        self.optimizer = None  # the RL optimizer, made by run_rl (SFT has its own, freed after the cold start)
        self.engine = build_engine(inputs.engine_cls, arch, self.tokenizer, cfg)
        self.link = EngineLink(self.dims, self.policy, self.engine, cfg.rollout.sync_bucket_mib)
        self.link.sync_weights()  # the engine starts from the policy's weights
        self.train_ds = PromptDataset(inputs.train, seed=cfg.seed + 17)
        self.quiet = quiet or not self.dims.is_main
        self.console = Console(self.dims.is_main, show_progress=not self.quiet and cfg.log.progress)
        if interrupts.armed():  # the CLI: from the first write on, a signal stops at a step boundary, never mid-write
            self.stop.install()
        self.logger = open_run_files(cfg, self.dims, self.ckpt, self.resume)
        # Sampling randomness differs per data-parallel rank; the TP ranks of one DP rank draw the same
        # (rank == dp_rank without TP). Training rollouts are also broadcast from TP rank 0 (EngineLink).
        self.sample_gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.dims.dp_rank)
        self.rng = RunRng(self.sample_gen, cfg.seed, self.dims.dp_rank)
        torch.manual_seed(cfg.seed * 7919 + self.dims.dp_rank)
        self.summary: dict = {"data": self.data_stats, "device": str(self.policy.device),
                              "precision": cfg.model.precision}
        if self.dims.is_main and self.logger.tb_note and not self.quiet:
            print(self.logger.tb_note)
        self._build_parts(cfg, inputs)
        self.table = self._register_parts()
        if self.resume:  # one pass over the parts restored by state_dict, once all of them are built
            self.ckpt.restore_parts(self.table, self.resume)

    def _build_parts(self, cfg: Config, inputs: RunInputs) -> None:
        """Held-out evaluation, cold-start SFT and the RL step, each from the inputs it uses."""
        hooks = RunHooks(log=self.logger.log, say=self.console.say, progress=self.console.progress,
                         stop_requested=self.stop.requested, preempted=self._preempted)
        self.evaluator = Evaluator(self.dims, self.link.current_engine, self.tokenizer, self.reward_fn,
                                   inputs.held_out, cfg.data.max_response_tokens, cfg.rl.eval.samples,
                                   cfg.rollout.temperature, cfg.rollout.top_p, inputs.agent)
        self.sft = ColdStartSFT(self.dims, self.policy, self.tokenizer, self.train_ds, cfg.sft, self.link,
                                self.evaluator, hooks, None if inputs.agent is None else inputs.agent.demonstration)
        sampling = SamplingParams(cfg.data.max_response_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p)
        source = build_rollout_source(
            self.dims, self.link, cfg.rl, cfg.rollout, sampling, self.tokenizer, self.train_ds, self.reward_fn,
            ahead_seed=cfg.seed * 7919 + 104_729 + self.dims.dp_rank,
            engine=EngineRecipe(cfg.rollout.engine, self.arch, self.tokenizer, engine_kwargs(cfg)),
            reward=RewardRecipe(cfg.reward.name, cfg.reward.timeout_s, self.injected_reward), agent=inputs.agent)
        self.step = RLStep(self.dims, self.policy, self.link, inputs.loss_fn, inputs.loss_cfg, self.reference,
                           cfg.rl, source, self.tokenizer, self.sample_gen)

    def _register_parts(self) -> CheckpointParts:
        """The parts a checkpoint holds as state dicts, in the order they are restored (megagspo.checkpoint.parts):
        one line each."""
        table = CheckpointParts()
        table.register("data", self.train_ds, Shared("data"))  # the sampler's RNG and epoch order
        table.register("rng", self.rng, PerRank("rng", RNG, note="RNG states reseeded"))
        source = self.step.source.checkpoint  # the batches generated ahead (rollout.staleness >= 1)
        if source is not None:
            table.register(source.key, source.state, PerRank(source.key, source.file, note=source.note,
                                                             legacy=source.legacy))
        table.register("summary", DictState(self.summary), Shared("summary"))
        return table

    def checkpoint_parts(self) -> RunParts:
        """What a checkpoint holds of this run (megagspo.checkpoint.state.RunParts): the table and the rest."""
        return RunParts(policy=self.policy, optimizer=self.optimizer, dataset=self.train_ds, metrics=self.logger,
                        arch=self.arch, table=self.table)

    # ------------------------------------------------------------------------------------------- the parts
    def run_sft(self) -> dict:
        return self.sft()

    def rl_step(self, step: int) -> dict:
        """One rollout batch through the stages of megagspo.rl.step; its metrics row."""
        return self.step(step, self.optimizer)

    def make_rl_optimizer(self):
        """Megatron's distributed optimizer (AdamW) for the RL updates (rl.optim.lr, betas, weight decay, clip);
        its fp32 master weights start from the policy's weights now (after cold-start SFT / init / resume)."""
        return self.policy.make_optimizer(optimizer_settings(self.cfg.rl.optim))

    # ------------------------------------------------------------------------------------------- the loop
    def run_rl(self, cold_start: dict, start_step: int = 0) -> dict:
        cfg = self.cfg.rl
        if cfg.router_aux_loss_coef is not None:  # RL's own load-balancing coefficient (the cold start used the model's)
            self.policy.set_router_aux_loss_coef(cfg.router_aux_loss_coef)
        self.optimizer = self.make_rl_optimizer()
        if self.resume:
            self.ckpt.load_optimizer(self.policy, self.optimizer, self.resume)
        if self.reference is not None and not self.reference.ready:
            self.reference.start_from(self.policy)
        bar = self.console.progress(cfg.steps, f"{cfg.loss.name.upper()} RL")
        rows = StepRows(self.evaluator, cfg.eval.every, cfg.steps, cold_start)  # held-out every rl.eval.every
        if bar is not None and start_step:
            bar.update(start_step)
        for step in range(start_step, cfg.steps):
            row = rows(step, self.rl_step(step))
            self.logger.log(row)
            self._checkpoint_and_maybe_stop(step + 1, rows.last_eval)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(**bar_postfix(row))
        if bar is not None:
            bar.close()
        return rows.last_eval

    def train(self, rl: bool = True) -> dict:
        self.stop.install()
        try:
            return self._train(rl)
        finally:
            self.stop.uninstall()
            self.run_lock.release()
            getattr(self.reward_fn, "close", lambda: None)()  # the verifier's worker, if any
            if self.agent is not None:
                self.agent.close()  # the tools' workers
            if hasattr(self, "step"):
                self.step.source.close()  # the rollout producer process, if any

    def _train(self, rl: bool) -> dict:
        t0 = time.perf_counter()
        signum = self.stop.requested()  # a signal after the run folder was written, before the first step
        if signum:
            raise self._preempted(f"stopped by {signal.Signals(signum).name} during start-up, before the first "
                                  "training step" + (f"; {self.resume['path']} is as it was: continue with --resume"
                                                     if self.resume else ""), signum)
        if self.resume and self.resume.get("config_changes"):  # which steps ran with which values (allow_config_change)
            self.summary["config_changes"] = list(self.resume["config_changes"])
        if self.resume and rl and self.cfg.rl.steps:
            return self._train_resumed(t0)
        base = self.evaluator()
        self.summary.update({"init/accuracy": base["eval/accuracy"], "init/timeouts": int(base["eval/timeouts"])})
        self.summary.update(self.run_sft())
        self._stop_if_metrics_unwritable()
        if self.cfg.sft.steps and self.cfg.log.save_checkpoint and rl and self.cfg.rl.steps:
            self.save_checkpoint("cold_start.pt")  # megagspo train model.init_from=<run>/cold_start.pt sft.steps=0
        cold = self.evaluator()
        if self.cfg.sft.steps:  # only what was measured, under the stage that ran (init/accuracy otherwise)
            self.summary.update(eval_record("cold_start", cold, self.cfg.rl.eval.samples))
        self.logger.log({"phase": "cold_start", "step": 0, "eval/accuracy": cold["eval/accuracy"],
                         "eval/timeouts": cold["eval/timeouts"], "init/accuracy": base["eval/accuracy"]})
        if rl and self.cfg.rl.steps:
            if self.reference is not None:  # written before step_000000: every RL checkpoint has its reference
                self.reference.start_from(self.policy)
            self.ckpt.save(self.checkpoint_parts(), 0, cold, phase="cold_start")  # step_000000: SFT is never redone
            self.checkpointed = True
            signum = self.stop.requested()
            if signum:
                raise self._preempted(f"stopped by {signal.Signals(signum).name} after cold-start SFT; checkpoint "
                                      "step_000000 written; continue with --resume", signum)
        self.console.say(cold_start_line(base, cold, self.cfg.sft.steps))
        if rl and self.cfg.rl.steps:
            final = self._timed_rl(cold)
            self.console.say(final_line(final, cold, self.cfg.rl.steps, self.cfg.rl.loss.name, self.cfg.sft.steps,
                                        self.cfg.rl.eval.samples, self.cfg.rollout.temperature))
        return self._finish(t0)

    def _train_resumed(self, t0: float) -> dict:
        """Continue an RL run from self.resume (weights, RNG, data position already restored)."""
        state = self.resume["state"]  # the summary so far was restored with the other parts (_register_parts)
        cold = dict(state["last_eval"])
        final = self._timed_rl(cold, state["step"]) if state["step"] < self.cfg.rl.steps else self._record_final(cold)
        self.console.say(f"held-out accuracy after {self.cfg.rl.steps} {self.cfg.rl.loss.name} steps (resumed at step "
                         f"{state['step']}): greedy {final['eval/accuracy']:.3f}" + timeouts_note(("after RL", final)))
        return self._finish(t0)

    def _timed_rl(self, cold: dict, start_step: int = 0) -> dict:
        """run_rl, its time added to the summary's rl/time_s (a resumed run adds to the earlier runs' time)."""
        t_rl = time.perf_counter()
        final = self.run_rl(cold, start_step)
        self.summary["rl/time_s"] = self.summary.get("rl/time_s", 0.0) + time.perf_counter() - t_rl
        return self._record_final(final)

    def _record_final(self, final: dict) -> dict:
        self.summary.update(eval_record("final", final, self.cfg.rl.eval.samples))  # only what was measured
        return final

    def _finish(self, t0: float) -> dict:
        if self.cfg.log.save_checkpoint:
            path = self.save_checkpoint()
            if path:
                self.summary["checkpoint"] = path
        self.summary["total_time_s"] = time.perf_counter() - t0
        if self.dims.is_main:
            write_summary(self.cfg, self.summary, self.logger.rows)
            self.console.say(f"run folder: {self.cfg.run_dir()} (metrics.jsonl, summary.json, plots)")
        self.logger.close()
        return self.summary

    # ------------------------------------------------------------------------- checkpoints and preemption
    def _checkpoint_and_maybe_stop(self, steps_done: int, last_eval: dict) -> None:
        """After each RL step: a checkpoint when due or when SIGTERM/SIGINT arrived; then stop on the signal."""
        self._stop_if_metrics_unwritable()
        signum = self.stop.requested()
        if signum or self.ckpt.due(steps_done, self.cfg.rl.steps):
            path = self.ckpt.save(self.checkpoint_parts(), steps_done, last_eval)
            self.checkpointed = True
            # a stop that arrived during the save (which may wait for the producer's batches): this checkpoint is
            # the run's last, rather than one more step and another checkpoint
            signum = signum or self.stop.requested()
        if signum:
            name = signal.Signals(signum).name
            raise self._preempted(f"stopped by {name} after RL step {steps_done}; checkpoint {path} written; "
                                  "continue with --resume (or checkpoint.resume=auto)", signum)

    def _stop_if_metrics_unwritable(self) -> None:
        """Collective: when rank 0 could not append to metrics.jsonl (disk full, ...), every rank stops here
        together, at a step boundary, instead of rank 0 exiting while its peers wait in a collective."""
        self.dims.on_rank0("appending to metrics.jsonl", self.logger.raise_write_error)

    def _preempted(self, msg: str, signum: int) -> Preempted:
        """The stop's one line; before this run's first checkpoint it names the one way on (start over), the
        same that the --resume refusal and a plain start's take-over give (megagspo.checkpoint.run_folder)."""
        self.logger.close()
        if not self.checkpointed:
            msg += f"; no checkpoint yet: {start_over_hint(self.cfg.run_dir())}"
        return Preempted(msg, 128 + signum)

    def save_checkpoint(self, name: str = "checkpoint.pt") -> Optional[str]:
        """Collective: the full (TP=EP=PP=1) weights as <run>/<name> (weights-only torch file, atomic), for
        `megagspo export` and `model.init_from`; a failed write stops every rank together."""
        return save_full_weights(self.dims, self.policy, os.path.join(self.cfg.run_dir(), name), self.arch,
                                 self.cfg.data.tokenizer, self.cfg.to_dict(), intact=self.ckpt.root)
