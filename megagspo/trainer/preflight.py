"""Everything a run checks before any compute, shared by the trainer and the dry run (`megagspo train
--dry-run` / `megagspo plan`), so that a recipe that passes the dry run starts: the process layout against
the batch sizes, the architecture (from the recipe, model.arch_file or the model.init_from folder) against
the tokenizer, the sequence length and the parallel layout, and model.init_from against the architecture
(the replay switches follow rl.routing_replay in the config itself). Data files are read by the trainer only
(a dry run may lack the cluster's files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megagspo.config import Config, ConfigError
from megagspo.policy.init_weights import InitSource, preflight_init_from
from megagspo.rl.sources import source_class
from megagspo.trainer.layout import check_layout
from moe.parallel import ParallelShape


@dataclass
class Preflight:
    shape: ParallelShape              # the sizes the run's ParallelDims will have
    arch: object                      # moe.architecture.Qwen3MoeArchitecture
    init_source: Optional[InitSource]  # None when model.init_from is not on this machine (dry run only)


def preflight(cfg: Config, world: int, vocab_size: int, *, init_from_present: bool = True) -> Preflight:
    """Raise ConfigError (naming the key) for the first thing that cannot work; `vocab_size` is the
    tokenizer's (0 when it is not on this machine)."""
    source_class(cfg.rollout.staleness, cfg.rl.filter_groups,  # which rollout source; what combines with what
                 cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
    arch = cfg.model.architecture(vocab_size)
    # batch sizes over the ranks, and the sizes the model is built from (arch_file / init_from's config.json /
    # the recipe) over TP / EP / PP
    shape = check_layout(cfg, world, arch)
    need = cfg.data.max_prompt_tokens + cfg.data.max_response_tokens
    if need > arch.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_tokens + data.max_response_tokens = {need} exceeds "
                          f"model.max_position_embeddings = {arch.max_position_embeddings}")
    init_source = preflight_init_from(cfg.model, arch) if init_from_present else None
    return Preflight(shape, arch, init_source)
