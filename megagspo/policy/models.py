"""The run's Megatron models, built from the config, the architecture and the process layout: the policy
(weights from the resumed checkpoint, else model.init_from), the frozen KL reference at rl.kl.coef > 0, and
the settings of the RL optimizer."""

from __future__ import annotations

from typing import Optional, Tuple

from megagspo.checkpoint import CheckpointManager
from megagspo.config import Config, OptimConfig
from megagspo.policy.init_weights import load_init_weights
from megagspo.policy.kl_reference import KLReference
from megagspo.policy.megatron_policy import MegatronPolicy
from moe.optimizer import OptimizerSettings
from moe.parallel import ParallelDims


def build_policy(cfg: Config, arch, dims: ParallelDims, *, frozen: bool = False,
                 adamw_class: Optional[type] = None) -> MegatronPolicy:
    """A Megatron model of the run's layout and model.* settings; `adamw_class` replaces the torch optimizer
    inside Megatron's distributed optimizer (tests inject one)."""
    return MegatronPolicy(arch, dims, cfg.parallel, cfg.rl.logprob_impl, frozen=frozen,
                          precision=cfg.model.precision, logprob_path=cfg.model.logprob_path,
                          logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
                          implementation=cfg.model.implementation(), adamw_class=adamw_class)


def build_models(cfg: Config, arch, dims: ParallelDims, ckpt: CheckpointManager, resume: Optional[dict],
                 init_source, adamw_class: Optional[type] = None) -> Tuple[MegatronPolicy, Optional[KLReference]]:
    """-> (policy, KL reference or None). The policy's weights come from the resumed checkpoint, else from
    model.init_from (a resume's weights come from its checkpoint: model.init_from is not read again). The
    reference is a second Megatron model of the same layout; call this before the run's RNG is reseeded, so
    that building it changes no random draw. Its weights are the policy's at the start of RL
    (KLReference.start_from: a fresh run, or a resume from step_000000, whose weights ARE the start of RL) or
    read back from <run>/reference.safetensors (KLReference.resume)."""
    policy = build_policy(cfg, arch, dims, adamw_class=adamw_class)
    if resume:
        ckpt.load_model(policy, resume)  # the engine gets these weights from the first weight sync
    else:
        load_init_weights(policy, init_source, arch)
    reference = None
    if cfg.rl.kl.coef > 0:
        reference = KLReference(dims, build_policy(cfg, arch, dims, frozen=True, adamw_class=adamw_class),
                                cfg.run_dir(), ckpt.run_id)
        if resume and resume["state"]["step"] > 0:
            reference.resume(resume["path"])
    return policy, reference


def optimizer_settings(optim: OptimConfig) -> OptimizerSettings:
    """Megatron's distributed optimizer (AdamW) from an optim section (rl.optim, sft.optim): its peak lr, betas,
    weight decay and gradient clip (the schedule is applied per step by megagspo.rl.schedule.lr_at)."""
    return OptimizerSettings(lr=optim.lr, weight_decay=optim.weight_decay, beta1=optim.beta1, beta2=optim.beta2,
                             clip_grad=optim.grad_clip)
