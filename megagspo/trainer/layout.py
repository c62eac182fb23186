"""Batch sizes against the process layout, checked before any compute, and the micro-batch split of a rank's
rows. Shared by the trainer and the dry run."""

from __future__ import annotations

import os

from megagspo.config import Config, ConfigError


def world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(cfg: Config, world: int) -> int:
    """Batch sizes against ranks and mini-batches, before any compute. -> data-parallel size."""
    tp = cfg.parallel.tensor_parallel
    ep = cfg.parallel.expert_parallel
    pp = cfg.parallel.pipeline_parallel
    if cfg.parallel.world_size and world != cfg.parallel.world_size:
        raise ConfigError(f"parallel.world_size = {cfg.parallel.world_size} but {world} processes were started")
    if world % (tp * pp) or world % (ep * pp):
        raise ConfigError(f"{world} processes do not divide into parallel.tensor_parallel={tp} x "
                          f"parallel.pipeline_parallel={pp} (and parallel.expert_parallel={ep} x "
                          f"parallel.pipeline_parallel={pp})")
    num_experts = cfg.model.num_experts
    if cfg.model.arch_file:
        from moe.hf_config import architecture_from_hf_config

        num_experts = architecture_from_hf_config(cfg.model.arch_file).num_experts
    if num_experts % ep:
        raise ConfigError(f"model.num_experts={num_experts} is not divisible by parallel.expert_parallel={ep}")
    dp = world // (tp * pp)  # the TP x PP ranks of one data-parallel rank share its prompts, rollouts and batches
    rl = cfg.rl
    if rl.prompts_per_step % dp:
        raise ConfigError(f"rl.prompts_per_step = {rl.prompts_per_step} does not divide over {dp} data-parallel ranks")
    local = rl.prompts_per_step // dp * rl.group_size
    if local % rl.mini_batches:
        raise ConfigError(
            f"each of the {dp} data-parallel ranks gets {rl.prompts_per_step // dp} prompts x {rl.group_size} = "
            f"{local} samples, which do not divide into rl.mini_batches = {rl.mini_batches}")
    mini = local // rl.mini_batches
    if rl.micro_batch_size and mini % rl.micro_batch_size:
        raise ConfigError(
            f"rl.micro_batch_size = {rl.micro_batch_size} does not divide the {mini} sequences of each mini-batch "
            f"on each data-parallel rank (rl.prompts_per_step {rl.prompts_per_step} / {dp} ranks x rl.group_size "
            f"{rl.group_size} / rl.mini_batches {rl.mini_batches}); valid values: 0 (whole mini-batch) or "
            f"{', '.join(str(d) for d in _divisors(mini))}")
    if cfg.sft.steps and cfg.sft.batch_size % dp:
        raise ConfigError(f"sft.batch_size = {cfg.sft.batch_size} does not divide over {dp} data-parallel ranks")
    sft_local = cfg.sft.batch_size // dp
    if cfg.sft.steps and cfg.sft.micro_batch_size and sft_local % cfg.sft.micro_batch_size:
        raise ConfigError(
            f"sft.micro_batch_size = {cfg.sft.micro_batch_size} does not divide the {sft_local} sequences of each "
            f"SFT batch on each data-parallel rank (sft.batch_size {cfg.sft.batch_size} / {dp} ranks); valid "
            f"values: 0 (whole batch) or {', '.join(str(d) for d in _divisors(sft_local))}")
    return dp


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_slices(rows: int, micro_batch_size: int) -> list:
    """Row slices of the micro-batches of `rows` sequences on a rank (micro_batch_size 0 = all in one)."""
    size = micro_batch_size or rows
    return [slice(i, i + size) for i in range(0, rows, size)]
