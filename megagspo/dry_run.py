"""Validate a (cluster) recipe on a CPU box without GPUs: config, layout divisibility, checkpoint shapes and
the memory plan. Used by `megagspo plan` and `megagspo train --dry-run`.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from megagspo.algorithm.registry import LossOptionError
from megagspo.algorithm.rollout_correction import describe_correction
from megagspo.config import Config, ConfigError, flatten_keys
from megagspo.data import load_tokenizer
from megagspo.kernels.policy_losses import build_loss
from megagspo.planner import MemoryPlan, PlanInputs, parameter_counts, plan_memory, require_fit
from megagspo.trainer.layout import planned_world_size
from megagspo.trainer.preflight import preflight
from moe.hf_checkpoint import CheckpointError, first_nonfinite_hf_tensor, hf_tensor_shapes


@dataclass(frozen=True)
class DryRunReport:
    world_size: int
    data_parallel: int
    micro_batch_tokens: int
    num_micro_batches: int
    checkpoint: str  # what was checked about the checkpoint
    loss: str  # the loss as megagspo.kernels.policy_losses.build_loss built it: name, implementation, every option
    missing_paths: tuple  # (config key, path) not present on this machine (checked on the cluster)
    total_params: int
    active_params: int
    plan: MemoryPlan

    def text(self, cfg: Config) -> str:
        p = cfg.parallel
        lines = [
            f"recipe {cfg.name}: {self.world_size} ranks = TP {p.tensor_parallel} x PP {p.pipeline_parallel} x EP "
            f"{p.expert_parallel} "
            f"(dense data-parallel {self.data_parallel})",
            f"model: {_count(self.total_params)} parameters, {_count(self.active_params)} active per token",
            f"checkpoint: {self.checkpoint}",
            f"loss: {self.loss}",
            *[f"not on this machine (checked when the run starts): {key} = {path}"
              for key, path in self.missing_paths],
            f"micro-batch (rl.batch.micro_batch_size = {cfg.rl.batch.micro_batch_size or 'whole mini-batch'}): "
            f"{self.micro_batch_tokens} tokens x {self.num_micro_batches} per rollout batch per rank "
            f"(loss {cfg.rl.loss.name}, routing replay {cfg.rl.routing_replay}, KL coef {cfg.rl.kl.coef:g}, log-prob "
            f"{'fused kernel' if cfg.rl.logprob_impl != 'torch' else 'naive torch'} from the "
            f"{'hidden states' if cfg.model.logprob_path == 'hidden' else 'logits'})",
            *([_pipeline_line(p.pipeline_parallel, self.num_micro_batches // cfg.rl.batch.mini_batches)]
              if p.pipeline_parallel > 1 else []),
            f"per-GPU memory ({cfg.parallel.gpu_memory_gib:.0f} GiB GPUs):",
            self.plan.table(),
        ]
        return "\n".join(lines)


def _pipeline_line(stages: int, micro_batches: int) -> str:
    """1F1B keeps every stage busy except for a fill/drain bubble of (PP - 1) / (M + PP - 1) of the step."""
    bubble = (stages - 1) / (micro_batches + stages - 1)
    advice = "" if micro_batches >= 2 * stages else \
        f"; lower rl.batch.micro_batch_size for at least {2 * stages} micro-batches per mini-batch"
    return (f"pipeline: {stages} stages, {micro_batches} micro-batch(es) per mini-batch through the 1F1B schedule, "
            f"idle bubble {bubble:.0%} of each update{advice}")


def _describe_loss(rl) -> str:
    """Build the loss exactly as the trainer does (the same validation) and list the options it received."""
    try:
        _, loss_config = build_loss(rl)
    except LossOptionError as exc:
        raise ConfigError(str(exc)) from None
    impl = "fused segmented GSPO kernel" if rl.loss.impl == "kernels" else "torch"
    fields = flatten_keys(dataclasses.asdict(loss_config))  # kl.coef, old_policy.source, ...: what the loss reads
    options = ", ".join(f"{k}={v!r}" for k, v in fields.items() if not k.startswith("old_policy.correction."))
    return (f"{rl.loss.name} ({impl}): {options}; rollout correction "
            f"{describe_correction(loss_config.old_policy.correction)}")


def _hf_weights_check(folder: str, check_weights: bool) -> str:
    """What the dry run says about an HF folder's values. By default it reads headers only (a 30B folder is
    ~61 GB: minutes of disk) and says that NaN / inf are found at start-up, where every rank checks each
    slice it reads before anything is trained or written; --check-weights reads every tensor now (one at a
    time, one aminmax each), e.g. before queueing a cluster job."""
    if not check_weights:
        return ("values not read here (headers only): NaN / inf weights are refused at start-up, before anything "
                "is written; add --check-weights to read them now")
    try:
        bad = first_nonfinite_hf_tensor(folder)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"model.init_from = {folder!r}: {exc}") from None
    if bad:
        raise ConfigError(f"model.init_from = {folder!r}: {bad} holds NaN or infinite values; a model cannot start "
                          "from non-finite weights")
    return "every value read and finite (--check-weights)"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def dry_run(cfg: Config, *, missing_paths=(), require_fitting: bool = True,
            check_weights: bool = False) -> DryRunReport:
    """Every check a real run makes before touching a GPU; raises ConfigError / LayoutError / PlanError /
    CheckpointError naming what is wrong. `missing_paths`: (key, path) pairs that the config loader found
    absent under `deferred_path_checks()` (cluster paths); they are reported, and skipped here. `check_weights`:
    read every value of an HF model.init_from folder too (else headers only, and the report says so)."""
    absent = {path for _, path in missing_paths}
    if cfg.data.tokenizer in absent:
        if not cfg.model.arch_file:
            raise ConfigError(f"data.tokenizer = {cfg.data.tokenizer!r} is not on this machine, so the vocabulary "
                              "must come from model.arch_file")
        vocab_size = 0
    else:
        vocab_size = load_tokenizer(cfg.data.tokenizer, cfg.data.prompt_format,
                                    cfg.data.chat_template_kwargs).vocab_size
    init_from = cfg.model.init_from
    if init_from in absent and not cfg.model.arch_file:
        raise ConfigError(f"model.init_from = {init_from!r} is not on this machine, so the architecture "
                          "must come from model.arch_file to be checked here")
    # the trainer's own start-up checks (layout, architecture, sequence length, model.init_from, replay)
    checked = preflight(cfg, planned_world_size(cfg), vocab_size, init_from_present=init_from not in absent)
    shape, arch = checked.shape, checked.arch
    counts = parameter_counts(arch)
    shapes = hf_tensor_shapes(arch)
    if checked.init_source is None:
        checkpoint = f"expected {len(shapes)} HF tensors; {init_from} is checked against them when the run starts"
    else:
        checkpoint = checked.init_source.description
        if checked.init_source.kind == "hf":
            checkpoint += "; " + _hf_weights_check(checked.init_source.path, check_weights)
    numel = sum(math.prod(shape) for shape in shapes.values())
    if numel != counts.total(arch):
        raise ConfigError(f"checkpoint tensors hold {numel} parameters but the architecture has "
                          f"{counts.total(arch)}: planner and checkpoint disagree")

    rl = cfg.rl
    loss = _describe_loss(rl)
    seq_tokens = cfg.max_sequence_tokens
    samples_per_rank = rl.batch.prompts_per_step // shape.dp_size * rl.batch.group_size
    # One forward/backward holds rl.batch.micro_batch_size sequences of this rank's share of a mini-batch (0 = the
    # whole share) at the maximum length; the trainer accumulates gradients over the micro-batches of a
    # mini-batch, so a rollout batch is mini_batches x (share / micro-batch) micro-batches per rank.
    mini_rows = samples_per_rank // rl.batch.mini_batches
    micro_rows = rl.batch.micro_batch_size or mini_rows
    micro = micro_rows * seq_tokens
    per_update = mini_rows // micro_rows
    if rl.batch.max_tokens_per_micro_batch:
        # packed micro-batches of whole sequences up to the budget (a longer sequence alone), planned for the
        # worst case of real tokens, every sequence at its maximum length: as many as fit the budget together
        fit = max(rl.batch.max_tokens_per_micro_batch // seq_tokens, 1)
        micro = shape.seq_length(fit * seq_tokens)
        per_update = -(-mini_rows // fit)
    num_micro_batches = rl.batch.mini_batches * per_update
    inputs = PlanInputs(world_size=shape.world_size, layout=shape.layout, micro_batch_tokens=micro,
                        num_micro_batches=num_micro_batches, micro_batches_per_update=per_update, fused_logprob=rl.logprob_impl != "torch",
                        logprob_path=cfg.model.logprob_path, logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
                        routing_replay=rl.routing_replay != "none", reference_model=rl.kl.coef > 0,
                        precision=cfg.model.precision, recompute=cfg.model.recompute,
                        gpu_memory_gib=cfg.parallel.gpu_memory_gib)
    plan = plan_memory(arch, inputs)
    if require_fitting:
        require_fit(plan)
    return DryRunReport(world_size=shape.world_size, data_parallel=shape.dp_size, micro_batch_tokens=micro,
                        num_micro_batches=num_micro_batches, checkpoint=checkpoint, loss=loss,
                        missing_paths=tuple(missing_paths),
                        total_params=counts.total(arch), active_params=counts.active(arch), plan=plan)
