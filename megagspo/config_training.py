"""The training phases' config sections: cold-start SFT (`sft`) and RL (`rl`, one section per component), and
the optimizer section both use.

`rl` nests one section per component, each a typed Config: rl.batch (RLBatchConfig), rl.loss (the loss's name
and its own Config's fields), rl.kl (the algorithm's KLConfig), rl.old_policy (OldPolicyConfig, with its
correction subsection, RolloutCorrectionConfig), rl.advantage (GroupAdvantageConfig, eq. 7), rl.filter, rl.optim
and rl.eval. megagspo.config loads them from recipes and overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megagspo.algorithm.advantages import GroupAdvantageConfig
from megagspo.algorithm.kl import KLConfig
from megagspo.algorithm.old_policy import OldPolicyConfig
from megagspo.algorithm.registry import LossOptionError, build_loss_config, registered_losses
from megagspo.config_checks import choice, nonneg_int, num, pos_int, require
from megagspo.errors import ConfigError

ROUTING_REPLAY = ("none", "r2", "r3")
LOSS_IMPLS = ("torch", "kernels")
LOGPROB_IMPLS = ("auto", "kernels", "torch")
SCHEDULES = ("constant", "cosine", "linear")
# Spellings other projects (and megagspo's SGLang config) use for a value that has one name here: refused with
# the right one. YAML reads a bare `off` as false, hence the boolean.
SPELLED = {("rl.routing_replay", "off"): "none", ("rl.routing_replay", False): "none",
            ("rl.loss.impl", "fused"): "kernels", ("rl.logprob_impl", "fused"): "kernels"}
SPELLED_CHOICES = {"rl.routing_replay": ROUTING_REPLAY, "rl.loss.impl": LOSS_IMPLS, "rl.logprob_impl": LOGPROB_IMPLS}
# keys that were booleans and became a choice: the boolean an earlier recipe or checkpoint holds -> its choice
FORMER_BOOLEANS = {"rl.old_policy.correction.method": {True: "seq_tis", False: "none"}}

# Sections below name themselves by class in their errors ("OptimConfig.lr must be ..."): the loader rewrites
# the class name into the dotted path the recipe used (rl.optim.lr, sft.optim.lr), as it does for the
# algorithm's own Configs (rl.kl is a KLConfig).


@dataclass
class OptimConfig:
    """Megatron's distributed AdamW and its learning-rate schedule (rl.optim and sft.optim)."""

    lr: float = 1e-3                # the peak learning rate
    schedule: str = "constant"      # constant | cosine | linear (decay to min_lr_ratio * lr, after the warmup)
    warmup_steps: int = 0           # linear warmup from 0 over this many optimizer steps
    min_lr_ratio: float = 0.1       # cosine / linear end at this fraction of lr
    weight_decay: float = 0.0       # AdamW's decoupled weight decay
    beta1: float = 0.9              # AdamW's first-moment decay
    beta2: float = 0.99             # AdamW's second-moment decay
    grad_clip: float = 1.0          # the global gradient norm is clipped to this

    def __post_init__(self) -> None:
        owner = type(self).__name__
        num(owner, "lr", self.lr, 0.0, 1.0, lo_open=True)
        choice(owner, "schedule", self.schedule, SCHEDULES)
        nonneg_int(owner, "warmup_steps", self.warmup_steps)
        num(owner, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        num(owner, "weight_decay", self.weight_decay, 0.0, 1.0)
        num(owner, "beta1", self.beta1, 0.0, 1.0)
        num(owner, "beta2", self.beta2, 0.0, 1.0)
        num(owner, "grad_clip", self.grad_clip, 0.0, lo_open=True)


def _sft_optim() -> OptimConfig:
    """SFT's defaults: a higher peak and a cosine decay after a short warmup (what cold start has always run)."""
    return OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)


@dataclass
class SFTConfig:
    """Cold start: supervised steps on demonstrations (prompt + answer) before RL."""

    steps: int = 150
    batch_size: int = 64
    eval_every: int = 0             # held-out greedy accuracy every N SFT steps (0 = only at the end)
    # Sequences per forward/backward on each rank; gradients accumulate over the micro-batches of a step
    # (one reduction, clip and optimizer step). 0 = the whole per-rank batch (batch_size / data-parallel).
    micro_batch_size: int = 0
    optim: OptimConfig = field(default_factory=_sft_optim)

    def __post_init__(self) -> None:
        nonneg_int("sft", "steps", self.steps)
        nonneg_int("sft", "eval_every", self.eval_every)
        nonneg_int("sft", "micro_batch_size", self.micro_batch_size)
        pos_int("sft", "batch_size", self.batch_size)


@dataclass
class RLBatchConfig:
    """Per step: prompts_per_step prompts x group_size responses, split into mini_batches updates."""

    prompts_per_step: int = 16      # B
    group_size: int = 8             # G
    mini_batches: int = 4           # optimizer updates per rollout batch (paper: 4)
    # Sequences per forward/backward on each rank: each mini-batch's share on a rank is split into
    # micro-batches whose gradients accumulate before the one reduction / clip / optimizer step of that
    # mini-batch (losses divide by global counts, so the sum equals the unsplit gradient).
    # 0 = the whole per-rank mini-batch in one forward/backward.
    micro_batch_size: int = 0
    # Packed sequences (THD, cu_seqlens): every model pass of the step runs each micro-batch as one stream of
    # whole sequences, no pad token computed (only the total rounded up to TP under sequence parallelism);
    # false = the same sequences one per row, right-padded to the longest (kept for comparison)
    packing: bool = True
    # > 0 (needs packing, instead of micro_batch_size): micro-batches by token budget. Each mini-batch's
    # sequences on a rank are split into the same number of micro-batches on every data-parallel rank (enough
    # for the fullest rank at this budget), balanced by tokens (greedy longest-first)
    max_tokens_per_micro_batch: int = 0

    def __post_init__(self) -> None:
        owner = "rl.batch"
        for name in ("prompts_per_step", "group_size", "mini_batches"):
            pos_int(owner, name, getattr(self, name))
        nonneg_int(owner, "micro_batch_size", self.micro_batch_size)
        nonneg_int(owner, "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        if not isinstance(self.packing, bool):
            raise ConfigError(f"rl.batch.packing must be true or false, got {self.packing!r}")
        if self.max_tokens_per_micro_batch and self.micro_batch_size:
            raise ConfigError(f"rl.batch.max_tokens_per_micro_batch = {self.max_tokens_per_micro_batch} and "
                              f"rl.batch.micro_batch_size = {self.micro_batch_size} both size the micro-batches: "
                              "set one")
        if self.max_tokens_per_micro_batch and not self.packing:
            raise ConfigError("rl.batch.max_tokens_per_micro_batch needs rl.batch.packing = true (token budgets pack "
                              "whole sequences into one stream)")
        if self.group_size < 2:
            raise ConfigError(f"rl.batch.group_size must be >= 2 (group advantages need >= 2 responses), got "
                              f"{self.group_size}")
        samples = self.prompts_per_step * self.group_size
        if samples % self.mini_batches:
            raise ConfigError(
                f"rl.batch.prompts_per_step * rl.batch.group_size = {samples} samples do not divide into "
                f"rl.batch.mini_batches = {self.mini_batches} equal mini-batches")

    @property
    def samples(self) -> int:
        """Responses per step: prompts_per_step x group_size."""
        return self.prompts_per_step * self.group_size


@dataclass
class RLLossConfig:
    """The policy loss: its name and the fields of that loss's own Config (megagspo.algorithm.losses; the KL
    and old-policy parts of it are rl.kl and rl.old_policy). An option the named loss lacks (dual_clip with
    gspo) is refused naming the key."""

    name: str = "gspo"              # gspo (eq. 6) | gspo_token (eqs. 14-15) | grpo (eq. 2)
    clip_low: float = 3e-4          # ratio clipped below at 1 - clip_low (the paper's GSPO values; GRPO: 0.2)
    clip_high: float = 4e-4         # ... and above at 1 + clip_high (GRPO: 0.27)
    dual_clip: Optional[float] = None  # grpo only: for A_t < 0 the objective is bounded below by dual_clip * A_t (> 1)
    aggregation: str = "seq_mean_token_mean"  # grpo only: seq_mean_token_mean (eq. 2) | token_mean (1 / tokens)
    validate: bool = True           # check each batch's shapes and finiteness in the loss (host syncs; false = skip)
    # torch (megagspo.algorithm) | kernels (the fused segmented GSPO kernel for gspo and gspo_token, forced: an
    # error where megagspo._C cannot serve the device; grpo has none and is refused)
    impl: str = "torch"

    def __post_init__(self) -> None:
        choice("rl.loss", "name", self.name, registered_losses())
        choice("rl.loss", "impl", self.impl, LOSS_IMPLS)
        num("rl.loss", "clip_low", self.clip_low, 0.0, 1.0, lo_open=True)
        num("rl.loss", "clip_high", self.clip_high, 0.0, lo_open=True)
        if self.dual_clip is not None:
            num("rl.loss", "dual_clip", self.dual_clip, 1.0, lo_open=True)
            self.dual_clip = float(self.dual_clip)  # `3` on the command line is an int to YAML


@dataclass
class FilterConfig:
    """Dynamic sampling (DAPO; megagspo/rl/dynamic_sampling.py): drop the groups whose rewards are all equal
    (zero advantage) and draw more prompts until the batch is full, in at most max_rounds rounds of generation
    (then zero-advantage groups fill what is left, reported as filter/filled_frac)."""

    enabled: bool = False           # true: drop zero-advantage groups and draw again (DAPO's dynamic sampling)
    max_rounds: int = 3             # rounds of generation per step at most

    def __post_init__(self) -> None:
        pos_int("rl.filter", "max_rounds", self.max_rounds)


@dataclass
class EvalConfig:
    """Held-out evaluation during RL."""

    every: int = 25                 # held-out accuracy every N RL steps (and at the end)
    samples: int = 4                # also score this many T=1 samples per held-out prompt (0 = greedy only)

    def __post_init__(self) -> None:
        pos_int("rl.eval", "every", self.every)
        nonneg_int("rl.eval", "samples", self.samples)


@dataclass
class RLConfig:
    """The RL phase, one section per component: rl.batch (sizes), rl.loss (the loss's own Config), rl.kl
    (KLConfig), rl.old_policy (OldPolicyConfig, with its correction subsection), rl.advantage
    (GroupAdvantageConfig, eq. 7), rl.filter (dynamic sampling), rl.optim, rl.eval. The algorithm's sections are
    its own frozen Config classes; build_loss_config(cfg.rl) assembles the loss's Config from rl.loss, rl.kl and
    rl.old_policy and validates the combination here and in the trainer."""

    steps: int = 100                # RL steps (each: one rollout batch, rl.batch.mini_batches updates)
    # routing replay, the one switch (moe.routing_replay on Megatron-Core's RouterReplay): none | r2 (pi_old's
    # routes, recorded in the recompute forward, replayed in training) | r3 (the rollout engine's routes
    # replayed; the engine is asked for them: rollout.record_routes follows this key)
    routing_replay: str = "none"
    # Measure the engine-trainer route gap every step (mismatch/route_*: the engine's top-k sets against the
    # trainer's at the same weights, and under replay the replayed routes against the live router's). The
    # engine then returns its routes (384 bytes a token at Qwen3-30B-A3B). null: on where rollout.engine_dtype
    # sets the engine's precision apart from the trainer's (auto: an fp32 CPU engine has no gap to measure).
    route_gap: Optional[bool] = None
    # The router's load-balancing loss coefficient during RL; null: model.router_aux_loss_coef, which the cold-start
    # SFT always uses (a model built with 0 has no aux loss to scale)
    router_aux_loss_coef: Optional[float] = None
    # auto (megagspo.kernels, with one warning where megagspo._C cannot serve the device) | kernels (forced: an
    # error instead of the fallback) | torch (a naive log_softmax; needs model.logprob_path=logits)
    logprob_impl: str = "auto"
    batch: RLBatchConfig = field(default_factory=RLBatchConfig)
    loss: RLLossConfig = field(default_factory=RLLossConfig)
    # kl.coef > 0: loss += coef * KL(pi_theta || pi_ref) to a frozen copy of the policy at the start of RL (a
    # second model's weights in memory; <run>/reference.safetensors). 0 = off (the GSPO paper trains without)
    kl: KLConfig = field(default_factory=KLConfig)
    # where pi_old comes from and, when recomputed, how the loss corrects for the rollout -> trainer gap
    old_policy: OldPolicyConfig = field(default_factory=OldPolicyConfig)
    advantage: GroupAdvantageConfig = field(default_factory=GroupAdvantageConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def reads_engine_routes(self) -> bool:
        """Whether the engine's routes are read: by R3 (replayed in training), with old_policy.source = rollout by
        the expert-volatility metric (pi_old is the engine, so its routes are pi_old's), and by the route-gap
        metrics (rl.route_gap). The one place this is
        decided: the engine is asked for them (rollout.record_routes) and the step packs them exactly then."""
        return self.routing_replay == "r3" or self.old_policy.source == "rollout" or bool(self.route_gap)

    def __post_init__(self) -> None:
        nonneg_int("rl", "steps", self.steps)
        choice("rl", "routing_replay", self.routing_replay, ROUTING_REPLAY)
        choice("rl", "logprob_impl", self.logprob_impl, LOGPROB_IMPLS)
        require("rl", "route_gap", self.route_gap in (None, True, False), self.route_gap,
                "true, false or null (on where rollout.engine_dtype is not auto)")
        if self.router_aux_loss_coef is not None:
            num("rl", "router_aux_loss_coef", self.router_aux_loss_coef, 0.0, 1e6)
        # The loss's own Config validates the combination (an option the chosen loss lacks): the same builder the
        # trainer calls, so a recipe that loads here builds there.
        try:
            build_loss_config(self)
        except LossOptionError as exc:
            raise ConfigError(str(exc)) from None
