"""One RL step as named stages, each a function of what the previous one produced:

    source   -> Rollouts, Scores   B prompts (this DP rank's share) -> G samples each, verifier rewards (errors
                             score 0, counted) and group advantages (eq. 7), from the run's rollout source:
                             synchronous, one step ahead or group-filtered (megagspo.rl.sources)
    prepare  -> UpdateBatch  the rollouts as one SequenceBatch (flat per-token tensors, megagspo.rl.batch) on the
                             model's device, shuffled into mini-batches (with a token budget: re-partitioned over
                             DP, megagspo.rl.dp_balance), split into MicroBatches by count or token budget
                             (megagspo.rl.micro_batches); each micro-batch's model view is one packed stream of
                             whole sequences (rl.batch.packing) or padded rows, its loss view the flat tensors
    old_policy               pi_old per micro-batch: a Megatron no-grad recompute (routes recorded for R2 and
                             volatility; R3 replays the engine's) or the engine's log-probs (GSPO §5.4); and
                             the frozen KL reference's log-probs when rl.kl.coef > 0
    update   -> Updates      per mini-batch: forward (routes replayed under R2/R3), the registered loss (GSPO
                             eq. 6 / GSPO-token eq. 14 / GRPO eq. 2) normalised by GLOBAL counts, backward over
                             its micro-batches, one optimizer step; expert volatility against pi_old's routes
    summarize -> metrics     sums over the data-parallel group, by name

`RLStep` is built from what the step uses (the process layout, the policy, the engine link, the loss, the
optional KL reference, the rl.* config, the rollout source, the tokenizer and the mini-batch generator) and never
sees the Trainer; `RLStep(...)(step, optimizer)` runs one rollout batch.

Legend (as in docs/architecture.md): B prompts, G samples per prompt, R = B*G responses, S model input length,
L response length, Ly MoE layers of this pipeline stage, K top-k, T tokens of a micro-batch's sequences, T' the
positions of its model input (the packed stream with its alignment tail, or rows * S).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from megagspo.algorithm import PackedBatch, merge_metrics
from megagspo.algorithm.losses import LossConfig
from megagspo.config import RLConfig
from megagspo.data.tokenizer import Tokenizer
from megagspo.policy.engine_link import EngineLink
from megagspo.policy.kl_reference import KLReference
from megagspo.policy.megatron_policy import MegatronPolicy
from megagspo.rl.batch import ModelView, SequenceBatch
from megagspo.rl.dp_balance import balance_over_dp
from megagspo.rl.micro_batches import micro_slices, token_budget_split
from megagspo.rl.peak_memory import PeakMemory
from megagspo.rl.schedule import lr_at
from megagspo.rl.batch_maker import Rollouts, Scores
from megagspo.rl.route_plan import RouteGap, RoutePlan
from megagspo.rl.source_protocol import RolloutSource
from megagspo.rl.step_metrics import agent_metrics, batch_metrics, metrics_row, mismatch_by_version
from moe.optimizer import set_lr
from moe.parallel import ParallelDims
from moe.volatility import VolatilityTally


@dataclass
class MicroBatch:
    """Micro-batch j of mini-batch k (the step's `index`-th): its sequences and the model's view of them."""

    k: int
    j: int
    index: int
    seqs: SequenceBatch
    view: ModelView

    def tokens_of(self, x):
        """A per-position model result at this micro-batch's sequence tokens, [T] in sequence order."""
        return self.view.tokens_of(x, self.seqs.num_tokens)


@dataclass
class OldPolicy:
    """What the old-policy pass computed, per micro-batch of the step (MicroBatch.index), in the model input's
    storage order ([B, S] / [1, T'], routes [T', Ly, K])."""

    logp: list                      # pi_old log-probs (LM-head stage; recompute only), else None
    routes: list                    # pi_old's (or the engine's) routes, else None
    ref_logp: list                  # KL reference log-probs (kl_coef > 0), else None
    route_gap: dict = field(default_factory=dict)  # rl.route_gap: the engine's routes against the trainer's


@dataclass
class UpdateBatch:
    minis: List[List[MicroBatch]]               # minis[k][j]
    tokens_per_mini: List[float]                # response tokens of each mini-batch over all DP ranks
    sequences_per_mini: int                     # sequences of each mini-batch over all DP ranks

    @property
    def micro_batches(self) -> List[MicroBatch]:
        return [mb for mini in self.minis for mb in mini]

    @staticmethod
    def inputs(micro: List[MicroBatch]) -> list:
        return [mb.view.model for mb in micro]


@dataclass
class Updates:
    metric_parts: list = field(default_factory=list)   # the loss functions' metrics (LM-head stage)
    grad_norms: list = field(default_factory=list)
    volatility_changed: float = 0.0
    volatility_total: float = 0.0
    lr: float = 0.0
    route_gap: dict = field(default_factory=dict)  # rl.route_gap under replay: replayed routes against the live ones


@dataclass
class RLStep:
    """One RL step's inputs, named (see the module docstring); call it with the step index and the RL optimizer."""

    dims: ParallelDims
    policy: MegatronPolicy
    link: EngineLink                 # the trainer's engine, which the source brings up to date after each update
    loss_fn: Callable                # (PackedBatch, loss_cfg) -> (loss, metrics): megagspo.kernels.policy_losses.build_loss
    loss_cfg: LossConfig             # the loss's Config, from rl.loss, rl.kl and rl.old_policy
    reference: Optional[KLReference]  # the frozen KL reference (rl.kl.coef > 0), else None
    rl: RLConfig
    source: RolloutSource            # scored rollouts: synchronous, one step ahead or group-filtered
    tokenizer: Tokenizer
    sample_gen: torch.Generator      # the mini-batch permutation

    def __post_init__(self) -> None:
        self.routes = RoutePlan(self.policy, self.rl)
        self.memory = PeakMemory(self.policy.device)

    def __call__(self, step: int, optimizer) -> dict:
        """One rollout batch: every stage in order; returns the step's metrics row (timings included)."""
        t0 = time.perf_counter()
        self.memory.start()
        sourced = self.source.next(step)
        rollouts, scores, times = sourced.rollouts, sourced.scores, dict(sourced.times)
        batch = self.prepare(rollouts, scores)
        t2 = time.perf_counter()
        old = self.old_policy(batch)
        times["time/old_logp_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        updates = self.update(batch, old, step, optimizer)
        times["time/train_s"] = time.perf_counter() - t3
        times.update(self.source.after_update(self.link))  # the source's engines get the weights after this update
        row = self.summarize(rollouts, scores, batch, updates)
        row.update(old.route_gap)
        row.update(updates.route_gap)
        row.update(sourced.metrics)
        row.update(mismatch_by_version(self.dims, batch.micro_batches, old.logp, step,
                                       recomputed=self.rl.old_policy.source == "recompute"))
        row.update(times)
        step_time = time.perf_counter() - t0
        row["time/step_s"] = step_time
        row["throughput/tokens_per_s"] = (float(rollouts.out.sampled_RL.sum()) * self.dims.dp_size) / step_time
        # the step's peak (generation included where this process's engine generates), the largest of the ranks
        row["memory/trainer_peak_gib"] = self.dims.world_max([self.memory.peak_gib()])[0]
        return row

    # -------------------------------------------------------------------------------------------- stages
    def prepare(self, rollouts: Rollouts, scores: Scores) -> UpdateBatch:
        """The rollouts as one SequenceBatch on the model's device, its sequences shuffled into rl.batch.mini_batches
        mini-batches (re-partitioned over DP by tokens with a token budget), each split into micro-batches."""
        cfg, out = self.rl, rollouts.out
        natural = max(map(len, out.prompt_ids)) + out.response_ids_RL.shape[1] - 1
        uses_engine_routes = out.routes_RPLyK is not None and self.routes.reads_engine_routes
        seqs = SequenceBatch.from_rollouts(out, scores.advantages_R, self.tokenizer.pad_id,
                                           row_len=self.dims.seq_length(natural),
                                           route_spec=self.policy.replay_spec if uses_engine_routes else None)
        seqs = seqs.to(self.policy.device)
        perm = torch.randperm(seqs.num_sequences, generator=self.sample_gen)
        sizes = cfg.batch
        mini_rows = list(perm.chunk(sizes.mini_batches))
        if sizes.max_tokens_per_micro_batch and self.dims.dp_size > 1:
            # each mini-batch's sequences re-partitioned over the DP ranks: equal counts, nearly equal tokens
            seqs, mini_rows = balance_over_dp(self.dims, seqs, mini_rows)
        lengths = torch.tensor(seqs.lengths)
        # the gradients of a mini-batch's micro-batches accumulate before its one reduction / clip / optimizer step
        if sizes.max_tokens_per_micro_batch:
            split = token_budget_split(mini_rows, lengths, sizes.max_tokens_per_micro_batch, self.dims)
        else:
            split = [[rows[sl] for sl in micro_slices(len(rows), sizes.micro_batch_size)] for rows in mini_rows]
        minis, index = [], 0
        for k, micro in enumerate(split):
            minis.append([])
            for j, rows in enumerate(micro):
                part = seqs.select(rows.tolist())
                minis[-1].append(MicroBatch(k, j, index, part, part.model_input(sizes.packing, self.dims)))
                index += 1
        # each mini-batch's response tokens: its micro-batches partition it
        response_tokens = [float(sum(mb.seqs.loss_mask_T.sum() for mb in mini)) for mini in minis]
        return UpdateBatch(minis=minis, tokens_per_mini=self.dims.dp_sum(response_tokens),
                           sequences_per_mini=sizes.samples // sizes.mini_batches)

    def old_policy(self, batch: UpdateBatch) -> OldPolicy:
        """pi_old's log-probs and routes of each micro-batch (and the reference's log-probs)."""
        policy, flat = self.policy, batch.micro_batches
        logp = [None] * len(flat)
        gap = {}
        engine = self.routes.engine_routes(flat)  # None where the step packed none
        if self.rl.old_policy.source == "recompute":
            context, routes, own = self.routes.for_recompute(engine)
            results = policy.run_micro_batches(batch.inputs(flat), context=context)
            logp = [r[0] if r is not None else None for r in results]
            if self.routes.measures_gap:  # the engine's top-k against the trainer's at the same weights (pi_old)
                own = own if own is not None else self.routes.own_routes(batch.inputs(flat))
                gap = RouteGap.of(self.dims, flat, engine, own, "mismatch/route_")
        else:  # pi_old is the engine: its routes are pi_old's
            routes = engine
        ref_logp = [None] * len(flat)
        if self.reference is not None:
            # log pi_ref: the frozen reference always routes with its own router, never replaying (its model has
            # no replay hooks): under R2/R3 the replayed routes are pi_old's / the engine's, and the reference
            # must stay the fixed start-of-RL policy, not follow them.
            ref_logp = [r[0] if r is not None else None for r in self.reference.logprobs(batch.inputs(flat))]
        return OldPolicy(logp, routes, ref_logp, gap)

    def update(self, batch: UpdateBatch, old: OldPolicy, step: int, optimizer) -> Updates:
        cfg, policy = self.rl, self.policy
        opt = cfg.optim
        result = Updates(lr=lr_at(step, cfg.steps, opt.lr, opt.warmup_steps, opt.schedule, opt.min_lr_ratio))
        set_lr(optimizer, result.lr)
        tally, override = VolatilityTally(), RouteGap()
        for k, micro in enumerate(batch.minis):
            policy.zero_grad()
            policy.set_micro_batches(len(micro))  # a token budget may split mini-batches differently
            old_routes = [old.routes[mb.index] for mb in micro]
            live_routes = [None] * len(micro)
            inputs = batch.inputs(micro)
            results = policy.run_micro_batches(inputs, context=self.routes.for_update(old_routes, live_routes),
                                               loss_fn=self._mini_batch_loss(batch, old, micro, k))
            result.metric_parts.extend(r for r in results if r is not None)  # the LM-head stage's metrics
            result.grad_norms.append(policy.step(optimizer))
            for j, mb in enumerate(micro):  # under replay: the replayed routes against the live routers' choice
                if live_routes[j] is not None:
                    override.add(mb.tokens_of(old_routes[j]), mb.tokens_of(live_routes[j]), mb.seqs.loss_mask_T)
            # expert volatility: the top-k choices of the policy after this update (a free forward, in every arm) vs
            # pi_old's on the same tokens, micro-batch by micro-batch, over this stage's layers
            if old_routes[0] is None:
                continue
            new_routes = [None] * len(micro)
            policy.run_micro_batches(inputs, context=self.routes.recording_into(new_routes))
            for j, mb in enumerate(micro):
                tally.add(mb.tokens_of(old_routes[j]).long(), mb.tokens_of(new_routes[j]).long(), mb.seqs.loss_mask_T)
        # over pipeline stages
        result.volatility_changed, result.volatility_total = self.dims.pp_sum(tally.counts())
        if self.routes.replays and self.routes.measures_gap:
            result.route_gap = override.metrics(self.dims, "replay/route_override_")
        return result

    def _mini_batch_loss(self, batch: UpdateBatch, old: OldPolicy, micro: List[MicroBatch], k: int) -> Callable:
        """(j, logp, entropy) -> the registered loss of micro-batch j of mini-batch k, normalised by GLOBAL
        counts (the whole mini-batch over all DP ranks): micro-batch losses add up to the mini-batch loss, and
        their accumulated gradients to its gradient."""
        recompute = self.rl.old_policy.source == "recompute"

        def policy_loss(j, logp_BS, entropy_BS):
            mb = micro[j]
            seqs = mb.seqs  # the loss reads the sequences' tokens of the model's outputs (not the alignment tail)
            packed = PackedBatch(
                logp_T=mb.tokens_of(logp_BS), loss_mask_T=seqs.loss_mask_T, cu_seqlens_S1=seqs.cu_seqlens_S1,
                num_global_sequences=batch.sequences_per_mini,
                old_logp_T=mb.tokens_of(old.logp[mb.index]) if recompute else None,
                rollout_logp_T=seqs.rollout_logp_T, advantages_S=seqs.advantages_S,
                num_global_tokens=max(batch.tokens_per_mini[k], 1.0), entropy_T=mb.tokens_of(entropy_BS),
                ref_logp_T=mb.tokens_of(old.ref_logp[mb.index]))
            return self.loss_fn(packed, self.loss_cfg)

        return policy_loss

    def summarize(self, rollouts: Rollouts, scores: Scores, batch: UpdateBatch, updates: Updates) -> dict:
        """The step's metrics: counts summed over the data-parallel group by name; the loss's metrics merged over
        the ranks as if computed on the union of their sequences (merge_metrics: fractions and means weighted by
        their counts), so they do not depend on which rank held which sequence."""
        m = self.dims.from_last_stage({k: float(v) for k, v in merge_metrics(updates.metric_parts).items()}
                                      if updates.metric_parts else None)
        out, rewards_R = rollouts.out, scores.rewards_R
        local = {
            "reward": float(rewards_R.sum()), "correct": float((rewards_R >= 1.0).sum()),
            "response_tokens": float(out.sampled_RL.sum(1).float().sum()),
            "rows": float(out.response_ids_RL.shape[0]),
            "reward_errors": float(scores.stats.errors), "vol_changed": updates.volatility_changed,
            "vol_total": updates.volatility_total, "nonzero_adv": float((scores.advantages_R != 0).sum()),
            "reward_clamped": float(scores.stats.clamped), "reward_timeouts": float(scores.stats.timeouts),
        }
        total = dict(zip(local, self.dims.dp_sum(list(local.values()))))
        row = metrics_row(total, self._union_over_dp(m), updates.grad_norms, updates.lr,
                          with_reference=self.reference is not None)
        row.update(batch_metrics(self.dims, batch.micro_batches))
        if out.agent_rows is not None:  # multi-turn trajectories (rollout.agent): the same on every rank
            row.update(agent_metrics(self.dims, out))
        return row

    def _union_over_dp(self, m: dict) -> dict:
        """Every data-parallel rank's merged loss metrics, merged again over the ranks (merge_metrics)."""
        keys = sorted(m)
        per_rank = self.dims.dp_gather([m[k] for k in keys])
        parts = [{k: torch.tensor(v, dtype=torch.float64) for k, v in zip(keys, values)} for values in per_rank]
        return {k: float(v) for k, v in merge_metrics(parts).items()}
