"""Batch sizes against the process layout, checked before any compute, and the micro-batch split of a rank's
rows. Shared by the trainer and the dry run."""

from __future__ import annotations

import os

from megagspo.config import Config, ConfigError
from moe.hf_config import architecture_from_hf_config
from moe.parallel import LayoutError, ParallelShape


def world_from_env() -> int:
    """The processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def planned_world_size(cfg: Config) -> int:
    """The world a dry run / plan checks: parallel.world_size when the recipe sizes a cluster, else this launch's."""
    return cfg.parallel.world_size or world_from_env()


def check_layout(cfg: Config, world: int, arch=None) -> ParallelShape:
    """Batch sizes against ranks and mini-batches, and the model's sizes against TP / EP / PP (check_model_sizes),
    before any compute. -> the run's ParallelShape (the sizes its ParallelDims will have). `arch`: the
    architecture the model is built from (the preflight passes it); None reads it from the recipe the same
    way, without the tokenizer's vocabulary."""
    tp = cfg.parallel.tensor_parallel
    ep = cfg.parallel.expert_parallel
    pp = cfg.parallel.pipeline_parallel
    if cfg.parallel.world_size and world != cfg.parallel.world_size:
        raise ConfigError(f"parallel.world_size = {cfg.parallel.world_size} but {world} processes were started")
    try:
        shape = ParallelShape(cfg.parallel.layout(), world)
    except LayoutError:
        raise ConfigError(f"{world} processes do not divide into parallel.tensor_parallel={tp} x "
                          f"parallel.pipeline_parallel={pp} (and parallel.expert_parallel={ep} x "
                          f"parallel.pipeline_parallel={pp})") from None
    check_model_sizes(cfg, arch)
    check_batch_sizes(cfg, shape.dp_size)
    return shape


def check_batch_sizes(cfg: Config, dp: int) -> None:
    """RL and SFT batches over `dp` data-parallel ranks (the TP x PP ranks of one data-parallel rank share its
    prompts, rollouts and batches), mini-batches and micro-batches."""
    rl = cfg.rl
    if rl.batch.prompts_per_step % dp:
        raise ConfigError(f"rl.batch.prompts_per_step = {rl.batch.prompts_per_step} does not divide over {dp} data-parallel ranks")
    local = rl.batch.prompts_per_step // dp * rl.batch.group_size
    if local % rl.batch.mini_batches:
        raise ConfigError(
            f"each of the {dp} data-parallel ranks gets {rl.batch.prompts_per_step // dp} prompts x {rl.batch.group_size} = "
            f"{local} samples, which do not divide into rl.batch.mini_batches = {rl.batch.mini_batches}")
    mini = local // rl.batch.mini_batches
    if rl.batch.micro_batch_size and mini % rl.batch.micro_batch_size:
        raise ConfigError(
            f"rl.batch.micro_batch_size = {rl.batch.micro_batch_size} does not divide the {mini} sequences of each mini-batch "
            f"on each data-parallel rank (rl.batch.prompts_per_step {rl.batch.prompts_per_step} / {dp} ranks x rl.batch.group_size "
            f"{rl.batch.group_size} / rl.batch.mini_batches {rl.batch.mini_batches}); valid values: 0 (whole mini-batch) or "
            f"{', '.join(str(d) for d in _divisors(mini))}")
    if cfg.sft.steps and cfg.sft.batch_size % dp:
        raise ConfigError(f"sft.batch_size = {cfg.sft.batch_size} does not divide over {dp} data-parallel ranks")
    sft_local = cfg.sft.batch_size // dp
    if cfg.sft.steps and cfg.sft.micro_batch_size and sft_local % cfg.sft.micro_batch_size:
        raise ConfigError(
            f"sft.micro_batch_size = {cfg.sft.micro_batch_size} does not divide the {sft_local} sequences of each "
            f"SFT batch on each data-parallel rank (sft.batch_size {cfg.sft.batch_size} / {dp} ranks); valid "
            f"values: 0 (whole batch) or {', '.join(str(d) for d in _divisors(sft_local))}")


def architecture_source(model_cfg) -> str:
    """Where the model's sizes come from, as an error message names it: model.arch_file, model.init_from's
    config.json (a Hugging Face folder, when no arch_file is set) or the recipe's model.* fields."""
    if model_cfg.arch_file:
        return f"model.arch_file = {model_cfg.arch_file!r}"
    if model_cfg.init_from_hf():
        return f"model.init_from = {model_cfg.init_from!r} (its config.json)"
    return "model"


def check_model_sizes(cfg: Config, arch=None) -> None:
    """Experts over EP, attention heads and vocabulary over TP, layers over PP, with the sizes the model is built
    from: `arch` (moe.architecture.Qwen3MoeArchitecture), else model.arch_file / model.init_from's config.json /
    the model.* fields, as ModelConfig.architecture chooses (the vocabulary is then checked only when it is
    known without the tokenizer). ConfigError names the source and the value that does not divide."""
    model = cfg.model
    source = architecture_source(model)
    if arch is None:
        if source == "model":
            arch = model
        else:
            try:
                arch = architecture_from_hf_config(model.arch_file or model.init_from)
            except ValueError as exc:
                raise ConfigError(f"{source}: {exc}") from None
    vocab = arch.vocab_size or 0  # 0: the tokenizer's, unknown here (divides everything)
    try:
        cfg.parallel.layout().check_model(arch.num_hidden_layers, arch.num_experts, arch.num_attention_heads,
                                     arch.num_key_value_heads, vocab)
    except LayoutError as exc:
        # "num_experts=6 is not divisible by expert_parallel=8" -> the recipe's key names on both sides
        text = str(exc).replace(" by ", " by parallel.", 1)
        where = f"model.{text}" if source == "model" else f"{source}: {text}"
        raise ConfigError(f"parallel.tensor_parallel / parallel.expert_parallel / parallel.pipeline_parallel do "
                          f"not fit the model: {where}") from None


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]

