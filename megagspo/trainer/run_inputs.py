"""A run's inputs, read and checked before any process group or model exists: data and tokenizer, the
preflight (layout, architecture, model.init_from), the reward, the loss and the rollout engine's class. Every
error here is a ConfigError (or the reader's own one-line error) naming the key, before any compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megagspo.agent.runner import AgentRollouts
from megagspo.agent.tools import get_tool
from megagspo.algorithm.losses import LossConfig
from megagspo.algorithm.registry import LossOptionError
from megagspo.config import Config, ConfigError
from megagspo.data import build_datasets
from megagspo.data.datasets import response_check_for
from megagspo.data.tokenizer import Tokenizer, load_tokenizer
from megagspo.kernels.policy_losses import build_loss
from megagspo.rewards import get_reward
from megagspo.rewards.bounded import with_time_limit
from megagspo.rollout import get_engine_class
from megagspo.trainer.layout import world_from_env
from megagspo.trainer.preflight import Preflight, preflight


@dataclass
class RunInputs:
    tokenizer: Tokenizer
    train: list                      # training Examples
    held_out: list                   # held-out Examples
    data_stats: dict
    checked: Preflight               # shape (the sizes of the run's ParallelDims), arch, init_source
    reward_fn: Callable              # (response, answer) -> [0, 1]
    loss_fn: Callable                # (PackedBatch, loss_cfg) -> (loss, metrics)
    loss_cfg: LossConfig
    engine_cls: type                 # the registered rollout engine
    agent: Optional[AgentRollouts] = None  # rollout.agent: multi-turn trajectories (None: single turn)


def read_run_inputs(cfg: Config, reward_fn: Optional[Callable] = None) -> RunInputs:
    """`reward_fn` replaces reward.name's verifier (tests inject one)."""
    tools = None
    if cfg.rollout.agent.tools:  # the prompts hold the template's tools block
        try:
            tools = [get_tool(name).schema() for name in cfg.rollout.agent.tools]
        except ValueError as exc:
            raise ConfigError(f"rollout.agent.tools: {exc}") from None
    try:
        # data.max_response_tokens limits the SFT demonstrations, or the answers a whole-answer reward compares
        tokenizer, train, held_out, data_stats = build_datasets(
            cfg.data, load_tokenizer(cfg.data.tokenizer, cfg.data.prompt_format, cfg.data.chat_template_kwargs,
                                     tools=tools),
            response_check=response_check_for(cfg.sft.steps, cfg.reward.name))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"data: {cfg.data.train_path or cfg.data.eval_path!r} (or data.eval_path) is not "
                          f"UTF-8 text ({exc})") from None
    checked = preflight(cfg, world_from_env(), tokenizer.vocab_size)
    # a worker process killed at reward.timeout_s (C-level loops included); started at the first call
    reward_fn = reward_fn or with_time_limit(get_reward(cfg.reward.name), cfg.reward.timeout_s)
    try:  # every rl.* loss option through the loss registry (torch, or the fused kernel when asked)
        loss_fn, loss_cfg = build_loss(cfg.rl)
    except LossOptionError as exc:
        raise ConfigError(str(exc)) from None
    agent = None
    if cfg.rollout.agent.enabled:
        try:
            agent = AgentRollouts(cfg.rollout.agent, tokenizer)
        except ValueError as exc:
            raise ConfigError(f"rollout.agent: {exc}") from None
    return RunInputs(tokenizer, train, held_out, data_stats, checked, reward_fn, loss_fn, loss_cfg,
                     get_engine_class(cfg.rollout.engine), agent)
