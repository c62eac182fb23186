"""Everything a run checks before any compute, shared by the trainer and the dry run (`megagspo train
--dry-run` / `megagspo plan`), so that a recipe that passes the dry run starts: the process layout against
the batch sizes, the architecture (from the recipe, model.arch_file or the model.init_from folder) against
the tokenizer, the sequence length and the parallel layout, and model.init_from against the architecture
(the replay switches follow rl.routing_replay in the config itself). Data files are read by the trainer only
(a dry run may lack the cluster's files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megagspo.agent.loop import available_agents, available_environments
from megagspo.agent.tools import available_tools
from megagspo.algorithm.registry import LossOptionError
from megagspo.config import Config, ConfigError
from megagspo.kernels.policy_losses import check_loss_impl
from megagspo.policy.init_weights import InitSource, preflight_init_from
from megagspo.rewards import available_rewards
from megagspo.rollout import available_engines
from megagspo.rollout.sglang import SGLangEngineConfig
from megagspo.rollout.sglang.config import with_engine_dtype
from megagspo.rl.source_kinds import source_kind
from megagspo.trainer.host_checks import check_host
from megagspo.trainer.layout import check_layout
from moe.architecture import Qwen3MoeArchitecture
from moe.parallel import ParallelShape


@dataclass
class Preflight:
    shape: ParallelShape              # the sizes the run's ParallelDims will have
    arch: Qwen3MoeArchitecture
    init_source: Optional[InitSource]  # None when model.init_from is not on this machine (dry run only)


def check_components(cfg: Config, world: int = 1) -> None:
    """The registry names and sections that need a component's own code to check, each raised as a ConfigError
    naming its key: the reward, the rollout engine and its sglang section, the fused loss kernel, the rollout
    source (for `world` processes). megagspo.config validates everything else on load without importing these
    components."""
    def choice(key: str, value, valid) -> None:
        if value not in valid:
            raise ConfigError(f"{key} = {value!r} is not valid; valid values: {', '.join(valid)}")

    choice("reward.name", cfg.reward.name, available_rewards())
    choice("rollout.engine", cfg.rollout.engine, available_engines())
    if cfg.rollout.engine == "sglang":
        try:
            with_engine_dtype(SGLangEngineConfig(**cfg.rollout.sglang), cfg.rollout.engine_dtype)
        except TypeError as exc:
            import inspect

            valid = ", ".join(inspect.signature(SGLangEngineConfig).parameters)
            raise ConfigError(f"rollout.sglang: {exc}; valid keys: {valid}") from None
        except ValueError as exc:
            raise ConfigError(f"rollout.sglang: {exc}") from None
    _check_agent(cfg, choice)
    try:
        check_loss_impl(cfg.rl)
    except LossOptionError as exc:
        raise ConfigError(str(exc)) from None
    # which rollout source; what combines with what
    source_kind(cfg.rollout.staleness, cfg.rl.filter.enabled, cfg.parallel.tensor_parallel *
                cfg.parallel.pipeline_parallel, cfg.rollout.producer, cfg.rollout.engine, cfg.rollout.partial, world)


def preflight(cfg: Config, world: int, vocab_size: int, *, init_from_present: bool = True) -> Preflight:
    """Raise ConfigError (naming the key) for the first thing that cannot work; `vocab_size` is the
    tokenizer's (0 when it is not on this machine)."""
    check_components(cfg, world)
    check_host(cfg)  # what depends on this machine: cores, the verifier's library, the output folder
    arch = cfg.model.architecture(vocab_size)
    # batch sizes over the ranks, and the sizes the model is built from (arch_file / init_from's config.json /
    # the recipe) over TP / EP / PP
    shape = check_layout(cfg, world, arch)
    need = cfg.max_sequence_tokens
    if need > arch.max_position_embeddings:
        after = "rollout.agent.max_total_tokens" if cfg.rollout.agent.enabled else "data.max_response_tokens"
        raise ConfigError(f"data.max_prompt_tokens + {after} = {need} exceeds "
                          f"model.max_position_embeddings = {arch.max_position_embeddings}")
    init_source = preflight_init_from(cfg.model, arch) if init_from_present else None
    return Preflight(shape, arch, init_source)


def _check_agent(cfg: Config, choice) -> None:
    """rollout.agent's registry names, and what its trajectories need of the tokenizer and the demonstrations."""
    agent = cfg.rollout.agent
    if agent.enabled:
        choice("rollout.agent.name", agent.name, available_agents())
        if agent.name == "environment":
            choice("rollout.agent.environment", agent.environment, available_environments())
        if cfg.data.tokenizer == "builtin":
            raise ConfigError("rollout.agent needs a tokenizer with a chat format: data.tokenizer = builtin has no "
                              "tool tokens (use data.tokenizer=builtin_tools, or a local HF tokenizer folder)")
    for name in agent.tools:
        choice("rollout.agent.tools", name, available_tools())
    if cfg.data.demo_tool_use and "add" not in agent.tools:
        raise ConfigError("data.demo_tool_use demonstrates calls to the add tool: set rollout.agent.name=tool_loop "
                          "with rollout.agent.tools=[add]")
