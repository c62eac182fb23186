"""Run configuration: one small validated dataclass per component, YAML recipes mapped onto them, and
`section.key=value` overrides from the command line.

Every error names the offending key (dotted path) and, for unknown keys, lists the valid ones. Defaults
live here and only here; recipes in `configs/` override what they need.

    cfg = load_config("configs/tiny_cpu.yaml", ["rl.steps=10", "seed=3"])

The rl section nests one typed section per component (RLConfig); the algorithm's own frozen Configs are sections
as they are (rl.kl is a KLConfig). Keys of earlier recipes, overrides and saved runs (the flat rl.lr, ...) are
moved onto their sections with one warning (megagspo.config_moves). Registry names that need the component's
code (the reward, the rollout engine and its sglang section, the fused loss kernel) are checked where those are
built, by the preflight every run and dry run goes through, so this module imports no rollout, kernel or
trainer code. The engine's replay flags are derived from rl.routing_replay (Config).

Why plain dataclasses and not pydantic (installed) or OmegaConf: the coercion / merge / override code here is
~100 lines with messages that name the dotted key, and the algorithm Config classes must stay free of a
third-party dependency; pydantic 2's lax mode accepts what this refuses ("1" for an int, 1 for true) and its
strict mode refuses what PyYAML writes for `1e-3` (a string: YAML 1.1 wants `1.0e-3`), its errors would reword
every message the tests and users rely on, and the YAML guards (duplicate keys, depth, size, alias bombs) are a
loader's job it does not do. Checked with pydantic 2.14 in this venv.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from megagspo.config_checks import choice, deferred_path_checks, nonneg_int, num, path_present, pos_int, require
from megagspo.config_moves import move_old_keys, old_keys_in, warn_moved
# the training phases' sections, loaded here and named from here too (megagspo.config.RLConfig, ...)
from megagspo.config_training import (FORMER_BOOLEANS, SPELLED, SPELLED_CHOICES, EvalConfig, FilterConfig,  # noqa: F401
                                      OptimConfig, RLBatchConfig, RLConfig, RLLossConfig, SFTConfig)
from megagspo.data.tokenizer import BUILTIN_TOKENIZERS, PROMPT_FORMATS, has_tokenizer_files
from megagspo.errors import ConfigError
from megagspo.errors import show_value as _show
from moe.architecture import Qwen3MoeArchitecture
from moe.hf_checkpoint import is_hf_model_folder
from moe.hf_config import architecture_from_hf_config
from moe.implementation import ATTENTION_PATHS, EXPERT_PATHS, RECOMPUTE_MODES, ModelImplementation
from moe.json_files import read_json
from moe.parallel import ParallelLayout
from moe.routing_replay import replay_available
from moe.yaml_files import yaml_depth


# ------------------------------------------------------------------------------------------- sections


PRECISIONS = ("fp32", "bf16")
_NOT_ARCHITECTURE = ("init_from", "arch_file", "precision", "logprob_path",
                     "logprob_chunk_tokens", "experts", "attention",
                     "recompute")  # model.* keys that are not Qwen3MoeArchitecture fields
LOGPROB_PATHS = ("hidden", "logits")


@dataclass
class ModelConfig:
    """Qwen3-MoE architecture fields (names as in HF's Qwen3MoeConfig). vocab_size 0 = the tokenizer's."""

    vocab_size: int = 0
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 64
    num_experts: int = 4
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    rope_theta: float = 10000.0
    max_position_embeddings: int = 64
    initializer_range: float = 0.02
    # The starting weights: a Hugging Face model folder (config.json + safetensors, one file or sharded with
    # its index; `save_pretrained` or `megagspo export` output), a megagspo run folder or checkpoint file
    # (`megagspo sft` output), or "" for a random init. An HF folder's config.json defines the architecture
    # unless model.arch_file is set; fields set above must then agree with it. Each rank reads only its slices.
    init_from: str = ""
    # An HF config.json / checkpoint folder / YAML of the architecture (e.g. configs/models/qwen3_30b_a3b.yaml).
    # When set it defines the whole architecture, and the fields above must stay at their defaults.
    arch_file: str = ""
    # Parameter precision: fp32, or bf16 (the GPU recipes): bf16 weights and activations with fp32 gradient
    # buffers and fp32 master weights / Adam moments in Megatron's distributed optimizer (moe/optimizer.py).
    precision: str = "fp32"
    # Token log-probs in the trainer: hidden (from the final hidden states and the LM head weight, chunks of
    # logprob_chunk_tokens tokens: the [tokens, vocab] logits are never materialised) | logits (Megatron's
    # output layer, then the log-prob kernel)
    logprob_path: str = "hidden"
    logprob_chunk_tokens: int = 1024
    # How the model computes (never what; moe/implementation.py): experts grouped (torch grouped GEMM) |
    # sequential (Megatron's per-expert loop); attention sdpa (torch SDPA, flash on CUDA) | local (Megatron's
    # DotProductAttention); recompute none | selective (core attention + MoE layers) | full (every layer).
    experts: str = "grouped"
    attention: str = "sdpa"
    recompute: str = "none"

    def __post_init__(self) -> None:
        nonneg_int("model", "vocab_size", self.vocab_size)
        choice("model", "experts", self.experts, EXPERT_PATHS)
        choice("model", "attention", self.attention, ATTENTION_PATHS)
        choice("model", "recompute", self.recompute, RECOMPUTE_MODES)
        choice("model", "precision", self.precision, PRECISIONS)
        choice("model", "logprob_path", self.logprob_path, LOGPROB_PATHS)
        pos_int("model", "logprob_chunk_tokens", self.logprob_chunk_tokens)
        if self.init_from and not path_present("model.init_from", self.init_from):
            raise ConfigError(f"model.init_from = {_show(self.init_from)}: no such file or folder")
        if self.arch_file:
            if not path_present("model.arch_file", self.arch_file):
                raise ConfigError(f"model.arch_file = {_show(self.arch_file)}: no such file or folder")
            defaults = ModelConfig()
            clash = [f.name for f in dataclasses.fields(self) if f.name not in _NOT_ARCHITECTURE
                     and getattr(self, f.name) != getattr(defaults, f.name)]
            if clash:
                raise ConfigError(f"model.arch_file is set, so model.{clash[0]} must not be (the architecture "
                                  f"comes from {_show(self.arch_file)}); set fields in one place only")

    def implementation(self):
        """moe.model.build_model's `implementation`: experts, attention, recompute."""
        return ModelImplementation(experts=self.experts, attention=self.attention, recompute=self.recompute)

    def architecture(self, vocab_size: int):
        if self.arch_file:
            try:
                arch = architecture_from_hf_config(self.arch_file)
            except ValueError as exc:
                raise ConfigError(f"model.arch_file: {exc}") from None
            if arch.vocab_size < vocab_size:
                raise ConfigError(f"model.arch_file vocab_size {arch.vocab_size} is smaller than the "
                                  f"tokenizer's {vocab_size}")
            return arch
        if self.init_from_hf():
            return self._architecture_of_init_folder(vocab_size)
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in _NOT_ARCHITECTURE}
        kwargs["vocab_size"] = self.vocab_size or vocab_size
        if kwargs["vocab_size"] < vocab_size:
            raise ConfigError(f"model.vocab_size = {self.vocab_size} is smaller than the tokenizer's {vocab_size}")
        try:
            return Qwen3MoeArchitecture(**kwargs)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None


    def init_from_hf(self) -> bool:
        """True when model.init_from is a Hugging Face model folder present on this machine."""
        return bool(self.init_from) and is_hf_model_folder(self.init_from)

    def _architecture_of_init_folder(self, vocab_size: int):
        """The architecture in model.init_from's config.json; recipe fields set away from their defaults
        must agree with it (so a recipe cannot silently describe another model than the weights)."""
        try:
            arch = architecture_from_hf_config(self.init_from)
        except ValueError as exc:
            raise ConfigError(f"model.init_from = {_show(self.init_from)}: its config.json: {exc}") from None
        defaults = ModelConfig()
        differ = [f"model.{f.name} = {getattr(self, f.name)!r} but config.json has {getattr(arch, f.name)!r}"
                  for f in dataclasses.fields(self) if f.name not in _NOT_ARCHITECTURE
                  and getattr(self, f.name) != getattr(defaults, f.name)
                  and getattr(self, f.name) != getattr(arch, f.name)]
        if differ:
            raise ConfigError(f"model.init_from = {_show(self.init_from)} defines the architecture, and the recipe "
                              "disagrees with it: " + "; ".join(differ) + " (drop these keys from the recipe)")
        if arch.vocab_size < vocab_size:
            raise ConfigError(f"model.init_from = {_show(self.init_from)}: config.json vocab_size {arch.vocab_size} is "
                              f"smaller than the tokenizer's {vocab_size}")
        return arch


TASKS = ("addition", "file")


@dataclass
class DataConfig:
    """Prompts with verifiable answers: the built-in synthetic task, or JSONL / parquet files."""

    task: str = "addition"          # addition | file
    num_digits: int = 2             # addition: operands in [0, 10^num_digits)
    train_size: int = 4000          # addition: distinct train problems
    eval_size: int = 300            # held-out problems (addition: disjoint from train; an eval_path file: a
    #                                 fixed subset of this many rows drawn with data.seed, all rows when fewer)
    train_path: str = ""            # file: .jsonl or .parquet
    eval_path: str = ""             # file: held-out set; "" = split eval_size rows off the train file
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # auto: the tokenizer in model.init_from when it is an HF folder holding one, else builtin |
    # builtin (digits + symbols) | path to a local HF tokenizer folder
    tokenizer: str = "auto"
    # auto: the tokenizer's chat template (generation prompt added) when it has one, else plain text |
    # chat | plain
    prompt_format: str = "auto"
    # Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3's non-thinking mode.
    chat_template_kwargs: dict = field(default_factory=dict)
    # addition: the fraction of the training problems whose ones digits carry that the cold-start SFT sees
    # demonstrated with that carry dropped ("18+25=" -> "33"); the reward and held-out accuracy check the true
    # sum, so GSPO has a systematic mistake to correct. 0 = every demonstration is the answer. The addition task
    # only: a file task's demonstrations are its answers (so a recipe that sets it can still read a file).
    demo_drop_carry: float = 0.0
    # addition with rollout.agent.tools = [add]: the fraction of the training problems the cold-start SFT sees solved
    # with the tool (a compact Hermes call to add, then the answer it returned); the others are answered directly,
    # carries dropped as demo_drop_carry says. The choice is fixed per problem (data.seed).
    demo_tool_use: float = 0.0
    max_prompt_tokens: int = 16
    max_response_tokens: int = 6
    drop_long_prompts: bool = False  # False: prompts over max_prompt_tokens are an error (counted, listed)
    seed: int = 1234

    def __post_init__(self) -> None:
        choice("data", "task", self.task, TASKS)
        for name in ("num_digits", "train_size", "eval_size", "max_prompt_tokens", "max_response_tokens"):
            pos_int("data", name, getattr(self, name))
        require("data", "demo_drop_carry", isinstance(self.demo_drop_carry, (int, float))
                 and not isinstance(self.demo_drop_carry, bool) and 0.0 <= self.demo_drop_carry <= 1.0,
                 self.demo_drop_carry, "a fraction in [0, 1]")
        require("data", "demo_tool_use", isinstance(self.demo_tool_use, (int, float))
                and not isinstance(self.demo_tool_use, bool) and 0.0 <= self.demo_tool_use <= 1.0,
                self.demo_tool_use, "a fraction in [0, 1]")
        if self.demo_tool_use and self.task != "addition":
            raise ConfigError("data.demo_tool_use is for the addition task (its demonstrations call the add tool)")
        if self.task == "addition":
            space = (10 ** self.num_digits) ** 2
            if self.train_size + self.eval_size > space:
                raise ConfigError(
                    f"data.train_size + data.eval_size = {self.train_size + self.eval_size} exceeds the "
                    f"{space} distinct {self.num_digits}-digit addition problems")
        if self.task == "file":
            if not self.train_path:
                raise ConfigError("data.train_path is required when data.task = 'file'")
            for name in ("train_path", "eval_path"):
                path = getattr(self, name)
                if path and not path_present(f"data.{name}", path, "file"):
                    raise ConfigError(f"data.{name} = {_show(path)}: no such file")
                if path and not path.endswith((".jsonl", ".json", ".parquet")):
                    raise ConfigError(f"data.{name} = {_show(path)}: expected a .jsonl or .parquet file")
        choice("data", "prompt_format", self.prompt_format, PROMPT_FORMATS)
        require("data", "chat_template_kwargs", isinstance(self.chat_template_kwargs, dict) and all(
            isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in self.chat_template_kwargs.items()),
            self.chat_template_kwargs, "a mapping of names to plain values (e.g. {enable_thinking: false})")
        if self.tokenizer not in ("auto", *BUILTIN_TOKENIZERS) and \
                not path_present("data.tokenizer", self.tokenizer, "dir"):
            raise ConfigError(f"data.tokenizer = {_show(self.tokenizer)}: expected 'auto', 'builtin', 'builtin_tools' "
                              "or a local tokenizer folder")


@dataclass
class RewardConfig:
    # see megagspo.rewards.available_rewards(); the name is checked where the reward is built (the preflight
    # every run and dry run goes through), so this module imports no reward code
    name: str = "exact_match"
    timeout_s: float = 10.0         # one verifier call past this scores 0, counted in reward/errors (0 = no limit)

    def __post_init__(self) -> None:
        num("reward", "timeout_s", self.timeout_s, 0.0)


ENGINE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8_sim")


AGENT_TRUNCATION_SIDES = ("right", "left")
PREFIX_POLICIES = ("fail", "keep")


@dataclass
class AgentConfig:
    """rollout.agent: multi-turn trajectories (megagspo.agent). name "" = single-turn rollouts."""

    # "" (single turn) | tool_loop (the built-in agent: the model calls rollout.agent.tools until it answers) |
    # environment (a registered stateful environment: rollout.agent.environment) | any agent registered with
    # megagspo.agent.register_agent; checked in the preflight
    name: str = ""
    tools: list = field(default_factory=list)     # tool_loop: registered tool names (megagspo.agent.register_tool)
    environment: str = ""                        # name = environment: a megagspo.agent.register_environment name
    max_turns: int = 4                           # assistant turns per trajectory
    # tokens after the first prompt, every turn and tool response included; a trajectory that reaches it ends as
    # "truncated": reward 0, counted in agent/truncated_frac. Each turn samples at most data.max_response_tokens.
    max_total_tokens: int = 256
    max_tool_response_tokens: int = 64           # a longer tool response is cut (agent/tool_truncations)
    tool_response_truncation: str = "right"      # right: keep its start | left: keep its end
    tool_timeout_s: float = 10.0                 # a tool still running then is killed; the model reads an error
    # Each turn the template's rendering of the conversation so far must equal the trajectory's tokens. fail: a
    # template that rewrites history (Qwen3's dropped <think> blocks) stops the run naming the turn and token |
    # keep: train on the tokens as sampled (what the engine saw), counting each rewrite in agent/prefix_rewrites
    prefix_policy: str = "fail"

    def __post_init__(self) -> None:
        require("rollout.agent", "name", isinstance(self.name, str), self.name, "a string")
        require("rollout.agent", "tools", isinstance(self.tools, list) and all(isinstance(t, str) for t in self.tools),
                self.tools, "a list of registered tool names")
        for key in ("max_turns", "max_total_tokens", "max_tool_response_tokens"):
            pos_int("rollout.agent", key, getattr(self, key))
        choice("rollout.agent", "tool_response_truncation", self.tool_response_truncation, AGENT_TRUNCATION_SIDES)
        choice("rollout.agent", "prefix_policy", self.prefix_policy, PREFIX_POLICIES)
        num("rollout.agent", "tool_timeout_s", self.tool_timeout_s, 0.0, 86400.0, lo_open=True)
        if self.name == "tool_loop" and not self.tools:
            raise ConfigError("rollout.agent.name = 'tool_loop' needs rollout.agent.tools (registered tool names)")
        if self.name == "environment" and not self.environment:
            raise ConfigError("rollout.agent.name = 'environment' needs rollout.agent.environment (a registered "
                              "environment's name)")

    @property
    def enabled(self) -> bool:
        return bool(self.name)


@dataclass
class RolloutConfig:
    # hf (transformers Qwen3MoeForCausalLM, KV cache) | sglang (GPU hosts); checked, with rollout.sglang, where
    # the engine is built (the preflight every run and dry run goes through)
    engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    # Derived, not a setting: the engine returns each token's routed experts exactly when something reads them,
    # rl.routing_replay = r3 (replayed in training), rl.old_policy.source = rollout (pi_old's routes for the expert-
    # volatility metric) or rl.route_gap (the engine-trainer route disagreement). Config sets it; a recipe value
    # that contradicts the derivation is refused.
    record_routes: Optional[bool] = None
    # The engine's own precision, whatever the trainer's (the engine-trainer gap routing replay exists for): auto
    # (the policy's precision on a GPU, fp32 on the CPU) | fp32 | bf16 | fp16 | fp8_sim (router and expert weights
    # rounded through float8_e4m3fn with a per-tensor scale, computed in bf16: FP8 inference against a BF16 or
    # FP32 trainer, as Qwen's stress test). The weight sync carries the trainer's exact weights; the embedded
    # engine rounds as it loads them. rollout.engine = sglang: the servers' --dtype / --quantization fp8 when
    # the engine launches them (docs/configuration.md).
    engine_dtype: str = "auto"
    # Weight sync after each update: the full model streams to the engine in buckets of at most this many
    # bytes, gathered one bucket at a time over TP / EP / PP (no rank ever holds the whole model).
    sync_bucket_mib: int = 512
    # engine = sglang: the fields of megagspo.rollout.sglang.SGLangEngineConfig (urls of running
    # servers or launch settings, sync_dir, colocate, ...), validated by the preflight before any compute.
    sglang: dict = field(default_factory=dict)
    # N >= 1: asynchronous rollouts, batch k generated with the policy N versions older than the update that
    # consumes it (the first N batches with the starting weights); 0: generate, then train (synchronous)
    staleness: int = 0
    # Who generates ahead (staleness >= 1): process = a producer process with its own threads, a queue of at most
    # N scored batches, dynamic sampling included (megagspo/rl/producer.py; rollout.engine = hf); thread = a
    # thread of the trainer, one batch ahead (megagspo/rl/rollouts_ahead.py); auto = process for hf, thread for
    # sglang (the server generates elsewhere)
    producer: str = "auto"
    producer_threads: int = 1       # the producer process's intra-op threads
    producer_cpus: list = field(default_factory=list)  # cores the producer process is pinned to ([]: not pinned)
    # Partial rollouts (staleness >= 1; the producer process, or the thread at N = 1): weights that arrive while a batch is generated load at once, and the
    # unfinished responses continue from their prefix under them; each token keeps the version that sampled it.
    # The switch points follow the weights' arrival: such a run depends on timing, not only on the seed.
    partial: bool = False
    # multi-turn, tool-calling trajectories (megagspo.agent); name "" = single-turn rollouts
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        require("rollout", "staleness", isinstance(self.staleness, int) and not isinstance(self.staleness, bool)
                and self.staleness >= 0, self.staleness, "an integer >= 0 (0: synchronous)")
        choice("rollout", "producer", self.producer, ("auto", "process", "thread"))
        pos_int("rollout", "producer_threads", self.producer_threads)
        require("rollout", "partial", isinstance(self.partial, bool), self.partial, "true or false")
        require("rollout", "producer_cpus", isinstance(self.producer_cpus, list) and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.producer_cpus),
            self.producer_cpus, "a list of core ids (integers >= 0)")
        if not isinstance(self.sglang, dict):
            raise ConfigError(f"rollout.sglang must be a mapping, got {_show(self.sglang)}")
        if self.sglang and self.engine != "sglang":
            raise ConfigError("rollout.sglang is set but rollout.engine is not 'sglang'")
        require("rollout", "record_routes", self.record_routes in (None, True, False), self.record_routes,
                 "true or false (better: unset, it follows rl.routing_replay and rl.old_policy.source)")
        pos_int("rollout", "sync_bucket_mib", self.sync_bucket_mib)
        choice("rollout", "engine_dtype", self.engine_dtype, ENGINE_DTYPES)
        num("rollout", "temperature", self.temperature, 0.0, 10.0, lo_open=True)
        num("rollout", "top_p", self.top_p, 0.0, 1.0, lo_open=True)


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1      # layers split over stages; micro-batches run Megatron's 1F1B schedule
    token_dispatcher: str = "alltoall"
    # Start each gradient bucket's data-parallel reduction during backward (Megatron DDP's overlap_grad_reduce;
    # micro-batches before the last accumulate without communicating). Same gradients either way.
    overlap_grad_reduce: bool = False
    # Cluster sizing, read by `megagspo plan` and `megagspo train --dry-run` (a run takes its world size
    # from torchrun; when world_size is set here, a run under another world size is refused).
    world_size: int = 0             # 0 = whatever torchrun starts
    gpu_memory_gib: float = 80.0    # per GPU (H100 80, H200 141)

    def __post_init__(self) -> None:
        pos_int("parallel", "tensor_parallel", self.tensor_parallel)
        pos_int("parallel", "expert_parallel", self.expert_parallel)
        pos_int("parallel", "pipeline_parallel", self.pipeline_parallel)
        choice("parallel", "token_dispatcher", self.token_dispatcher, ("alltoall", "allgather"))
        nonneg_int("parallel", "world_size", self.world_size)
        num("parallel", "gpu_memory_gib", self.gpu_memory_gib, 0.0, lo_open=True)

    def layout(self) -> ParallelLayout:
        """The TP / EP / PP sizes as moe.parallel describes them (the only place a recipe's sizes become one)."""
        return ParallelLayout(tensor_parallel=self.tensor_parallel, expert_parallel=self.expert_parallel,
                              pipeline_parallel=self.pipeline_parallel)


@dataclass
class LogConfig:
    out_dir: str = "runs"
    progress: bool = True
    tensorboard: bool = True        # written when the tensorboard package is installed
    plots: bool = True
    save_checkpoint: bool = True

    def __post_init__(self) -> None:
        pass


RESUME_MODES = ("", "never", "latest", "auto")


@dataclass
class CheckpointConfig:
    """Resumable checkpoints in <run>/checkpoints/step_XXXXXX (megagspo.checkpoint; docs/robustness.md)."""

    every_steps: int = 25           # also at the end of RL, after cold-start SFT, and on SIGTERM/SIGINT (0 = only those)
    keep_last: int = 3              # finished checkpoints kept (older ones deleted after each new one)
    # "" = a fresh run, refused where the run folder holds an earlier run (a finished run of this config: its
    # summary is printed instead) | never (what --overwrite sets): a fresh run, the earlier run moved whole to
    # <run>.replaced-<time>/ once everything has been validated | latest (what --resume sets): the newest intact
    # checkpoint, an error when there is none | auto: latest when there is one, else as never (ablation cells,
    # requeued jobs) | a checkpoint / checkpoints / run folder (megagspo.checkpoint.run_folder)
    resume: str = ""
    metrics_tail: int = 10000       # metrics rows stored in each checkpoint (restores metrics.jsonl if it is lost)
    # A resume refuses a change to what defines the run (seed, model, data, reward, the loss and its clip /
    # KL / old-policy / replay settings), naming each difference; true lets it continue with the new values.
    allow_config_change: bool = False

    def __post_init__(self) -> None:
        nonneg_int("checkpoint", "every_steps", self.every_steps)
        pos_int("checkpoint", "keep_last", self.keep_last)
        nonneg_int("checkpoint", "metrics_tail", self.metrics_tail)
        if self.resume not in RESUME_MODES and not path_present("checkpoint.resume", self.resume):
            raise ConfigError(f"checkpoint.resume = {_show(self.resume)}: expected latest, auto, never, or an "
                              "existing checkpoint or run folder")


def _check_run_name(name: Any) -> None:
    """The run folder is log.out_dir/<name>: a name must be one plain path component, so a run never lands
    outside log.out_dir (`..`, `../x`, an absolute path) or in log.out_dir itself beside other runs (empty)."""
    rule = ("a run name is one plain folder name: not empty, not '.' or '..', no '/' (so not absolute), no NUL, "
            "at most 255 bytes")
    ok = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name and \
        (os.sep == "/" or os.sep not in name) and (os.altsep is None or os.altsep not in name) and \
        len(name.encode("utf-8", "surrogatepass")) <= 255  # a folder name's limit on every common filesystem
    if not ok:
        raise ConfigError(f"name = {_show(name)}: {rule}")


@dataclass
class Config:
    name: str = "tiny_cpu"
    seed: int = 0
    threads: int = 2                # torch intra-op threads (per process)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _check_run_name(self.name)
        nonneg_int("", "seed", self.seed)
        pos_int("", "threads", self.threads)
        if self.model.logprob_path == "hidden" and self.rl.logprob_impl == "torch":
            raise ConfigError("model.logprob_path = 'hidden' computes log-probs chunk by chunk with megagspo.kernels, "
                              "but rl.logprob_impl = 'torch' needs the whole logits: set rl.logprob_impl to auto or "
                              "kernels, or model.logprob_path=logits")
        if self.rl.batch.packing and self.model.attention == "local":
            raise ConfigError("rl.batch.packing = true needs model.attention = sdpa (Megatron's local "
                              "DotProductAttention takes no packed sequences): set model.attention=sdpa or "
                              "rl.batch.packing=false")
        if self.data.tokenizer == "auto":
            self.data.tokenizer = self._auto_tokenizer()
        if self.rl.routing_replay != "none":
            ok, why = replay_available()
            if not ok:
                raise ConfigError(f"rl.routing_replay = {_show(self.rl.routing_replay)} is not available yet: {why}")
        self._derive_replay_flags()

    def _derive_replay_flags(self) -> None:
        """rl.routing_replay is the one switch for routing replay; the engine-side flags follow from it (and
        from rl.old_policy.source). A recipe may still spell them out (a run's saved config.yaml does), but a value that
        contradicts the derivation is refused naming both keys."""
        rl = self.rl
        if rl.route_gap is None:  # measured where the engine's precision is set apart from the trainer's
            rl.route_gap = self.rollout.engine_dtype != "auto"
        routes = rl.reads_engine_routes
        given = self.rollout.record_routes
        if given is not None and given != routes:
            raise ConfigError(f"rollout.record_routes = {given} contradicts rl.routing_replay = "
                              f"{rl.routing_replay!r} with rl.old_policy.source = {rl.old_policy.source!r} (the engine's routes are "
                              f"{'read' if routes else 'never read'}): remove rollout.record_routes, it follows "
                              "rl.routing_replay")
        self.rollout.record_routes = routes
        if self.rollout.engine == "sglang":
            mode = "r3" if rl.routing_replay == "r3" else "off"  # SGLangEngineConfig's own spelling of "none"
            given = self.rollout.sglang.get("routing_replay")
            if given is not None and given != mode:
                raise ConfigError(f"rollout.sglang.routing_replay = {_show(given)} contradicts rl.routing_replay = "
                                  f"{rl.routing_replay!r}: remove rollout.sglang.routing_replay, it follows "
                                  "rl.routing_replay")
            self.rollout.sglang = {**self.rollout.sglang, "routing_replay": mode}

    def _auto_tokenizer(self) -> str:
        """data.tokenizer = auto: model.init_from's own tokenizer when it has one (also when the folder is
        a cluster path absent from this machine, where a dry run reports it), else the built-in one."""
        init_from = self.model.init_from
        if not init_from or os.path.isfile(init_from) or init_from.endswith((".pt", ".safetensors")):
            return "builtin"  # a checkpoint file holds no tokenizer files
        if not os.path.exists(init_from) or has_tokenizer_files(init_from):
            return init_from
        return _recorded_tokenizer(init_from) or "builtin"

    @property
    def max_sequence_tokens(self) -> int:
        """A sequence's tokens at most: the prompt, then one response, or a multi-turn trajectory's
        rollout.agent.max_total_tokens (every turn and tool response)."""
        after = self.rollout.agent.max_total_tokens if self.rollout.agent.enabled else self.data.max_response_tokens
        return self.data.max_prompt_tokens + after

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def run_dir(self) -> str:
        return os.path.join(self.log.out_dir, self.name)


def _recorded_tokenizer(folder: str) -> str:
    """The tokenizer a megagspo run folder (its config.yaml) or step checkpoint (its trainer_state.json) was
    trained with; "" when none is recorded or the file cannot be read (the run then names what is wrong)."""

    config_yaml, state_json = os.path.join(folder, "config.yaml"), os.path.join(folder, "trainer_state.json")
    value = None
    if os.path.isfile(config_yaml):
        try:  # the recipe reader: size, depth and duplicate-key guards included
            value = (read_yaml_mapping(config_yaml, "run config").get("data") or {}).get("tokenizer")
        except (ConfigError, AttributeError):
            value = None
    if not (isinstance(value, str) and value) and os.path.isfile(state_json):
        try:
            value = read_json(state_json).get("tokenizer")
        except ValueError:  # JsonFileError: too large, too deep, not JSON, unreadable
            value = None
    return value if isinstance(value, str) and value else ""


def _coerce_value(path: str, value: Any, default: Any) -> Any:
    """YAML gives ints for floats like `1` and strings for `1e-3`; accept those, reject real mismatches."""
    if isinstance(value, (str, bool)) and (path, value) in SPELLED:
        shown = "off (YAML reads a bare off as false)" if value is False else _show(value)
        raise ConfigError(f"{path} = {shown} is spelled {SPELLED[(path, value)]!r} here; valid values: "
                          f"{', '.join(SPELLED_CHOICES[path])}")
    if isinstance(value, bool) and path in FORMER_BOOLEANS:
        return FORMER_BOOLEANS[path][value]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {_show(value)}")
        return value
    if isinstance(default, float) and not isinstance(value, bool):
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{path} must be a number, got {_show(value)}") from None
    if isinstance(default, int) and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(default, str) and value is None:
        return ""
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{path} must be a string, got {_show(value)}")
    return value


def declared_default(f: dataclasses.Field) -> Any:
    """The default a dataclass field declares, before any __post_init__ resolves it (data.tokenizer: auto); a fresh
    instance for a section (SFT's optim differs from RL's). tools/config_table.py documents these defaults."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _leaf_paths(cls, prefix: str) -> dict:
    """{leaf name: [dotted paths]} of every key under the dataclass `cls` at `prefix`, sections included."""
    out: dict = {}
    for f in dataclasses.fields(cls):
        default = declared_default(f)
        if dataclasses.is_dataclass(default):
            for leaf, paths in _leaf_paths(type(default), f"{prefix}{f.name}.").items():
                out.setdefault(leaf, []).extend(paths)
        else:
            out.setdefault(f.name, []).append(f"{prefix}{f.name}")
    return out


def _did_you_mean(cls, key: str, prefix: str) -> str:
    """' (did you mean rl.loss.clip_low?)' for a key close to one a section nests (a typo of a flat key of an
    earlier recipe, `rl.clip_lo`, lands in the section that holds clip_low now); '' when nothing is close."""
    leaves = _leaf_paths(cls, prefix)
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    return f" (did you mean {' or '.join(leaves[close[0]])}?)" if close else ""


def _build(cls, raw: dict, prefix: str, base: Any = None):
    """An instance of `cls` from the mapping `raw` at dotted `prefix`; a field that is itself a dataclass is a
    section, built from its own mapping on top of the field's declared default (`base` there). Every error is a
    ConfigError naming the dotted key: a section's message naming its class (KLConfig.coef, OptimConfig.lr) is
    rewritten into the path the recipe used (rl.kl.coef, sft.optim.lr)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix[:-1] or 'the config'} must be a mapping, got {_show(raw)}")
    declared = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in declared:
            raise ConfigError(f"unknown config key {_show(path)}{_did_you_mean(cls, key, prefix)}; valid keys"
                              f"{' in ' + prefix[:-1] if prefix else ''}: {', '.join(declared)}")
        default = declared_default(declared[key])
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), {} if value is None else value, f"{path}.", default)
        else:
            kwargs[key] = _coerce_value(path, value, default)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        named = message.replace(f"{cls.__name__}.", prefix) if prefix else message
        if isinstance(exc, ConfigError) or named != message:
            raise ConfigError(named) from None
        raise ConfigError(f"{prefix[:-1] or 'config'}: {message}") from None


def flatten_keys(tree: dict, prefix: str = "") -> dict:
    """{'rl': {'loss': 'grpo'}} (or {'rl.loss': 'grpo'}) -> {'rl.loss': 'grpo'}: the dotted key paths that
    overrides, ablation arms and resume comparisons name."""
    out: dict = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_keys(value, f"{path}."))
        else:
            out[path] = value
    return out


def parse_overrides(overrides) -> dict:
    """['rl.steps=10', 'seed=2'] -> nested dict; values parsed as YAML scalars."""
    out: dict = {}
    for item in overrides or ():
        if "=" not in item:
            raise ConfigError(f"override {_show(item)} must look like section.key=value (e.g. rl.steps=10)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {_show(item)}: empty key component")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {_show(item)} conflicts with an earlier override of {_show(part)}")
        # the recipe's own parser: nesting pre-scanned (a 100,000-deep `[[[…` would crash the loader), duplicate
        # keys refused, every failure a ConfigError naming the override
        node[parts[-1]] = parse_yaml(value, f"override {_show(item)}: the value") if value != "" else ""
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(raw: dict, overrides=None, where: str = "the config") -> Config:
    """The Config of a recipe mapping plus command-line overrides. Keys from before the rl sections (rl.lr,
    sft.lr, ...) are moved onto their sections in each source apart, so a new-style override of an old-style
    recipe (or the reverse) lands where it is meant to; each source that used them warns once."""
    merged = move_old_keys(raw or {}, where)
    moved: dict = {}
    for item in overrides or ():  # one by one, so the last override of a key wins whichever name each one uses
        tree = parse_overrides([item])
        moved.update(old_keys_in(tree))
        merged = _merge(merged, move_old_keys(tree, "the overrides", warn=False))
    if moved:
        warn_moved(moved, "the overrides", plural=True)
    return _build(Config, merged, "")


MAX_YAML_BYTES = 1 << 20  # a recipe is a few KB; a larger file is refused before it is parsed


def _yaml_loader():
    """PyYAML's C-accelerated safe loader where libyaml is present (the pure-Python one takes minutes on a
    large file), refusing a key that appears twice in one mapping: YAML would silently keep the last one,
    so a second `rl:` section would reset every key of the first to its default."""
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class UniqueKeySafeLoader(base):
        def construct_mapping(self, node, deep=False):
            first_line = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges a mapping in; its keys may be overridden here
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # an unhashable key is refused by PyYAML itself
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise ConfigError(f"duplicate key {_show(key)} at line {line} (first at line "
                                      f"{first_line[key]}): YAML would silently keep only the last one")
                first_line[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeySafeLoader


MAX_YAML_DEPTH = 256  # libyaml's composer recurses per nested collection: ~50,000 levels crash the process


def _yaml_depth(text: str) -> int:
    """The deepest nesting of YAML collections in `text` (the non-recursive pre-scan shared with moe)."""
    return yaml_depth(text, MAX_YAML_DEPTH)


def parse_yaml(text: str, where: str):
    """The YAML document in `text` (safe, duplicate keys refused); every failure is a ConfigError naming `where`."""
    try:
        if _yaml_depth(text) > MAX_YAML_DEPTH:
            raise ConfigError(f"{where} nests collections more than {MAX_YAML_DEPTH} deep: not a recipe")
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(exc.args[0] if str(exc).startswith(where) else f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply to be a recipe") from None


def _yaml_problem(exc) -> str:
    """'did not find expected key (line 3, column 2)': the parser's own words and place, cut to one line."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem[:200]}{where}"


def read_yaml_mapping(path: str, what: str = "config file") -> dict:
    """A YAML file holding a mapping at the top level; every way it can be wrong is a ConfigError naming it."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} does not exist")
    try:
        size = os.path.getsize(path)
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"{what} {path!r} is {size} bytes; a recipe is at most {MAX_YAML_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path!r} is not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    raw = parse_yaml(text, f"{what} {path!r}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path!r} must hold a mapping at the top level")
    return raw


def load_config(path: Optional[str] = None, overrides=None) -> Config:
    return config_from_dict(read_yaml_mapping(path) if path else {}, overrides, path or "the config")
