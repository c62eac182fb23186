"""Cold-start SFT: cross-entropy on prompt -> answer + eos demonstrations of the training split, with its own
optimizer (freed afterwards), so that RL starts from a policy with nonzero reward.

`ColdStartSFT` is built from the process layout, the policy, the tokenizer, the prompt stream, the sft.* config,
the engine link (weights to the engine for evaluation), the evaluator and the run's hooks (log, say, progress,
stop); it never sees the Trainer."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Callable, Optional

from megagspo.config import SFTConfig
from megagspo.data.datasets import PromptDataset
from megagspo.data.tokenizer import Tokenizer
from megagspo.metrics_log import timeouts_note
from megagspo.policy.engine_link import EngineLink
from megagspo.policy.megatron_policy import MegatronPolicy
from megagspo.policy.models import optimizer_settings
from megagspo.rl.batch import SequenceBatch
from megagspo.rl.micro_batches import micro_slices
from megagspo.rl.schedule import lr_at
from megagspo.trainer.hooks import RunHooks
from moe.optimizer import set_lr
from moe.parallel import ParallelDims


@dataclass
class ColdStartSFT:
    dims: ParallelDims
    policy: MegatronPolicy
    tokenizer: Tokenizer
    demonstrations: PromptDataset    # sample(n) -> Examples (prompt and answer)
    sft: SFTConfig
    engine: EngineLink
    evaluate: Callable[[], dict]     # held-out evaluation (megagspo.trainer.evaluation.Evaluator)
    hooks: RunHooks
    # example -> (ids after the prompt, loss mask): a multi-turn demonstration's assistant turns and, at mask 0, the
    # tool responses between them (megagspo.agent.AgentRollouts.demonstration); None: answer + eos, all in the loss
    demonstration: Optional[Callable] = None

    def __call__(self) -> dict:
        """Cold start: cross-entropy on prompt -> answer+eos demonstrations (train split only)."""
        cfg = self.sft
        if cfg.steps == 0:
            return {}
        opt = self.policy.make_optimizer(optimizer_settings(cfg.optim))
        bar = self.hooks.progress(cfg.steps, "cold-start SFT")
        per_rank = cfg.batch_size // self.dims.dp_size
        micro_rows = micro_slices(per_rank, cfg.micro_batch_size)
        self.policy.set_micro_batches(len(micro_rows))
        t_start = time.perf_counter()
        for step in range(cfg.steps):
            lr = lr_at(step, cfg.steps, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule, cfg.optim.min_lr_ratio)
            set_lr(opt, lr)
            loss_sum, gnorm = self._step(opt, micro_rows)
            do_eval = bool(cfg.eval_every) and (step + 1) % cfg.eval_every == 0
            if step % 10 == 0 or step == cfg.steps - 1 or do_eval:
                row = {"phase": "sft", "step": step, "sft/loss": loss_sum, "sft/lr": lr, "grad_norm": float(gnorm)}
                if do_eval:
                    self.engine.sync_weights()
                    held_out = self.evaluate()
                    row["eval/accuracy"], row["eval/timeouts"] = held_out["eval/accuracy"], held_out["eval/timeouts"]
                    self.hooks.say(f"SFT step {step + 1}: loss {loss_sum:.3f}, held-out accuracy "
                                   f"{row['eval/accuracy']:.3f}" + timeouts_note(("", held_out)))
                self.hooks.log(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum:.3f}")
            signum = self.hooks.stop_requested() if step < cfg.steps - 1 else None
            if signum:  # SFT is not checkpointed mid-way (step_000000 follows it): stop now, redo it on resume
                raise self.hooks.preempted(f"stopped by {signal.Signals(signum).name} during cold-start SFT "
                                           f"(after step {step + 1} of {cfg.steps})", signum)
        if bar is not None:
            bar.close()
        self.engine.sync_weights()
        return {"sft/time_s": time.perf_counter() - t_start}

    def _step(self, opt, micro_rows: list):
        """One optimizer step on a fresh batch of demonstrations. -> (loss summed over ranks, gradient norm)."""
        seqs, natural = self._demonstrations(self.dims.local_slice(self.demonstrations.sample(self.sft.batch_size)))
        (n_tok,) = self.dims.dp_sum([float(seqs.loss_mask_T.sum())])
        self.policy.zero_grad()
        micro = [seqs.select(range(rows.start, min(rows.stop, seqs.num_sequences))) for rows in micro_rows]
        lmask = [m.rows_of(m.loss_mask_T, False).float() for m in micro]

        def lm_loss(i, logp_BS, _entropy_BS):  # gradients accumulate; divided by the GLOBAL token count
            loss = -(logp_BS * lmask[i]).sum() / n_tok
            return loss, float(loss.detach())

        # One right-padded row per demonstration. Every position below the batch's natural length counts in the
        # router aux loss, row padding included (SFT always has: its numbers, the golden metrics among them, stay
        # as they were); the packed stream and the RL step's rows count only the sequences' own tokens.
        inputs = [m.model_input(False, self.dims, aux_len=natural).model for m in micro]
        losses = self.policy.run_micro_batches(inputs, loss_fn=lm_loss)
        loss_local = sum(x for x in losses if x is not None)  # 0 on the stages without the LM head
        gnorm = self.policy.step(opt)
        (loss_sum,) = self.dims.dp_sum(self.dims.pp_sum([loss_local]))
        return loss_sum, gnorm

    def _demonstrations(self, batch: list):
        """prompt + demonstration (Example.demo: the answer unless data.demo_drop_carry) + eos of each example of
        `batch`, as a SequenceBatch on the model's device -> (it, the natural row length before TP alignment)."""
        tok = self.tokenizer
        masks = None
        if self.demonstration is None:
            answers = [tok.encode(ex.demo) + [tok.eos_id] for ex in batch]  # demonstration, else answer
        else:
            answers, masks = zip(*(self.demonstration(ex) for ex in batch))
        prompt_ids = [list(ex.prompt_ids) for ex in batch]
        natural = max(map(len, prompt_ids)) + max(map(len, answers)) - 1
        seqs = SequenceBatch.from_demonstrations(prompt_ids, list(answers), tok.pad_id, self.dims.seq_length(natural),
                                                 answer_masks=masks)
        return seqs.to(self.policy.device), natural
