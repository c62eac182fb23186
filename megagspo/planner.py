"""Per-GPU memory planner for a Qwen3-MoE GSPO recipe on a TP / EP / PP / DP layout.

Every term is plain arithmetic on the architecture and the layout, written out so a reader can check it by
hand (tests pin it against hand-computed cases). The figure is the busiest rank: the first pipeline stage
(embedding + its layers + the most micro-batches in flight) or the last (its layers + the LM head and the
log-prob path), whichever is larger.

Bytes per parameter (Megatron-Core DDP and distributed optimizer, moe/optimizer.py), by `precision`
(config `model.precision`):
  bf16: weights 2 B; gradients 4 B (fp32 main-grad buffer, grad_reduce_in_fp32); optimizer 12 B (fp32 master
        copy + Adam m and v).
  fp32: weights 4 B; gradients 4 B; optimizer 8 B (Adam m and v only: the distributed optimizer's master
        weights for fp32 parameters are views of the parameters themselves, no copy).
  The optimizer state is sharded over the parameter's data-parallel group (dense: DP; experts: expert-DP).
  Tensor parallelism splits the linear layers and the embedding / output layer; the norms (2 per layer, the
  q/k norms, the final norm) and the router are replicated on every TP rank. DDP pads each parameter's start
  to 64 elements and each bucket to a multiple of lcm(DP, 128) elements: a few KiB per rank, left out
  (tests/test_planner_allocations.py checks these terms against the bytes Megatron actually allocates).
Activations per token per layer, stored for backward (no recompute, flash attention, sequence parallel so that
every term is divided by TP), written for bf16 (2 B); an fp32 run stores each at 4 B (the fp32 softmax lse and
router logits are 4 B either way):
  attention: 2 B * (2h [norm in/out] + (nq + 2 nkv) d [qkv] + nq d [core out]) + 4 B * nq [softmax lse]
  MoE MLP:   2 B * (2h [norm in/out]) + 4 B * E [router logits] + k * 2 B * (h + 3 I) [per routed copy:
             permuted input, fc1 output (gate and up), activation]
  dense MLP: 2 B * (2h + h + 3 I_dense)
Activation recompute (`recompute`, config model.recompute; moe.implementation):
  selective: Megatron recomputes the core attention and the whole MoE layer in backward. Attention drops the
             softmax lse (4 B * nq; q, k, v and the core output are kept as the checkpoint's inputs / the next
             linear's input); an MoE layer keeps only 2 B * 2h (norm in/out, its checkpoint input). One MoE
             layer's other activations (4 B * E + k * 2 B * (h + 3 I)) are live again while it is recomputed.
  full:      each layer keeps only its input, 2 B * h; one layer's full activations (attention + its MLP, as
             without recompute) are live again while it is recomputed.
Log-prob path (last stage; `logprob_path`, config model.logprob_path):
  logits: per token logits 2 V/TP (4 V/TP in fp32); naive adds an fp32 log-softmax 4 V/TP and its fp32
          gradient 4 V/TP, fused adds 16 B (per-token lse, max, log-prob, entropy).
  hidden: no [tokens, V/TP] logits: the LM head's input kept for backward, 2 B * h per token of the full
          sequence (4 B in fp32; all-gathered over TP under sequence parallelism, so not divided by TP); one
          chunk's logits, 2 B * V/TP * min(chunk, tokens) (4 B in fp32), live in forward and again in backward;
          the kernel's per-token statistics, 16 B (32 B at TP > 1: the vocab shard's partial max / sum-exp /
          entropy sum / target logit before their all-reduce). d weight is added straight into the fp32
          main-grad buffer (counted under gradients): no [V/TP, h] accumulator; autograd's transient
          gradient of the weight (2 B * V/TP * h, zeros) stands where the logits path's output layer makes
          its weight gradient, so neither path counts it.
Routing replay: tokens * (MoE layers on the stage) * top-k * (1 B if experts <= 256 else 2 B).
KL reference policy (rl.kl.coef > 0): a frozen second copy of the weights in the run's precision, sharded over
TP / EP / PP exactly like the policy's (no gradients, no optimizer state; its no-grad forward's activations
are freed before the training forward, so they add nothing to the peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe.architecture import Qwen3MoeArchitecture
from moe.implementation import RECOMPUTE_MODES
from moe.parallel import LayoutError, ParallelLayout, ParallelShape

GIB = 1024**3

# precision -> (weight bytes, optimizer bytes) per parameter; gradients are 4 B (fp32 main grad) in both.
# fp32: the distributed optimizer's "master" shard of an fp32 parameter is a view of the parameter itself.
PRECISION_BYTES = {"bf16": (2, 12), "fp32": (4, 8)}
_OPTIMIZER_LABEL = {"bf16": "optimizer (fp32 master + Adam, sharded over DP)",
                    "fp32": "optimizer (fp32 Adam m + v, sharded over DP; the fp32 weights are the master)"}


class PlanError(ValueError):
    """The recipe does not fit: the message names the largest term."""


@dataclass(frozen=True)
class PlanInputs:
    world_size: int
    layout: ParallelLayout
    micro_batch_tokens: int  # tokens in one forward/backward on one DP rank (rl.batch.micro_batch_size x length)
    # micro-batches per rollout batch per DP rank (mini-batches x micro-batches each): the routing-replay
    # buffer holds all of them
    num_micro_batches: int = 1
    # micro-batches per optimizer step (one 1F1B schedule call; 0 = num_micro_batches): the first pipeline
    # stage holds the activations of min(PP, this many) of them at once
    micro_batches_per_update: int = 0
    fused_logprob: bool = True
    # model.logprob_path: "logits" (Megatron's output layer materialises [tokens, V/TP]) or "hidden" (the
    # chunked linear kernel); megagspo.dry_run passes the recipe's (the trainer's default is "hidden")
    logprob_path: str = "logits"
    logprob_chunk_tokens: int = 1024  # model.logprob_chunk_tokens (hidden path)
    routing_replay: bool = False
    reference_model: bool = False  # rl.kl.coef > 0: the frozen KL reference policy's weights
    precision: str = "bf16"  # model.precision: "bf16" or "fp32" parameters (moe.optimizer.PRECISIONS)
    recompute: str = "none"  # model.recompute: none | selective | full (moe.implementation.RECOMPUTE_MODES)
    gpu_memory_gib: float = 80.0
    reserve_gib: float = 6.0  # CUDA context, NCCL buffers, allocator fragmentation

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch_tokens", "num_micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {self.precision!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.logprob_path not in ("hidden", "logits"):
            raise ValueError(f"logprob_path must be one of hidden, logits, got {self.logprob_path!r}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens!r}")
        if self.logprob_path == "hidden" and not self.fused_logprob:
            raise ValueError("logprob_path 'hidden' runs the chunked log-prob kernel: fused_logprob must be True")

    @property
    def shape(self) -> ParallelShape:
        """The layout over world_size (moe.parallel.ParallelShape; a LayoutError where it does not divide)."""
        return ParallelShape(self.layout, self.world_size)


@dataclass(frozen=True)
class ParameterCounts:
    embedding: int
    output_layer: int
    attention_per_layer: int
    dense_mlp_per_layer: int
    router_per_layer: int
    experts_per_layer: int
    final_norm: int

    def total(self, arch: Qwen3MoeArchitecture) -> int:
        moe_layers = arch.num_moe_layers
        dense_layers = arch.num_hidden_layers - moe_layers
        return (self.embedding + self.output_layer + self.final_norm
                + arch.num_hidden_layers * self.attention_per_layer
                + dense_layers * self.dense_mlp_per_layer
                + moe_layers * (self.router_per_layer + self.experts_per_layer))

    def active(self, arch: Qwen3MoeArchitecture) -> int:
        """Parameters one token passes through (top-k experts of each MoE layer)."""
        experts_active = self.experts_per_layer * arch.num_experts_per_tok // arch.num_experts
        return self.total(arch) - arch.num_moe_layers * (self.experts_per_layer - experts_active)


def parameter_counts(arch: Qwen3MoeArchitecture) -> ParameterCounts:
    h, d = arch.hidden_size, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    attention = h * (nq + 2 * nkv) * d + nq * d * h + 2 * d + 2 * h  # qkv, proj, q/k norm, 2 layer norms
    return ParameterCounts(
        embedding=arch.vocab_size * h,
        output_layer=0 if arch.tie_word_embeddings else arch.vocab_size * h,
        attention_per_layer=attention,
        dense_mlp_per_layer=3 * h * arch.intermediate_size,
        router_per_layer=arch.num_experts * h,
        experts_per_layer=arch.num_experts * 3 * h * arch.moe_intermediate_size,
        final_norm=h,
    )


@dataclass(frozen=True)
class MemoryPlan:
    terms_gib: dict  # name -> GiB on the busiest rank
    stage: str  # "first" or "last" pipeline stage (or "only")
    total_gib: float
    capacity_gib: float

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.capacity_gib

    @property
    def largest_term(self) -> str:
        return max(self.terms_gib, key=self.terms_gib.get)

    def table(self) -> str:
        width = max(len(k) for k in self.terms_gib)
        lines = [f"{name:<{width}}  {gib:9.2f} GiB" for name, gib in self.terms_gib.items()]
        lines.append(f"{'total (' + self.stage + ' stage)':<{width}}  {self.total_gib:9.2f} GiB "
                     f"of {self.capacity_gib:.1f} GiB usable")
        return "\n".join(lines)


# Over 60 lines: one memory term per line of the table it returns; split, the terms' shared sizes would repeat.
def _stage_terms(arch: Qwen3MoeArchitecture, inputs: PlanInputs, first: bool, last: bool) -> dict:
    shape = inputs.shape
    tp, ep, pp, etp = shape.tp_size, shape.ep_size, shape.pp_size, shape.layout.expert_tensor_parallel
    dp, expert_dp = shape.dp_size, shape.expert_dp_size
    counts = parameter_counts(arch)
    layers = arch.num_hidden_layers // pp
    # Even PP split; the busiest stage is assumed to hold the most MoE layers.
    moe_layers = math.ceil(arch.num_moe_layers / pp)
    dense_layers = layers - moe_layers if layers >= moe_layers else 0

    h, d = arch.hidden_size, arch.head_dim
    # Replicated on every TP rank: the 2 layer norms and the q/k norms of each layer, and each MoE layer's router.
    replicated_per_layer = 2 * h + 2 * d
    tp_split = layers * (counts.attention_per_layer - replicated_per_layer) + dense_layers * counts.dense_mlp_per_layer
    dense_params = tp_split // tp + layers * replicated_per_layer + moe_layers * counts.router_per_layer
    if first:
        dense_params += counts.embedding // tp
    if last:
        dense_params += counts.output_layer // tp + counts.final_norm
        if arch.tie_word_embeddings and pp > 1:
            # tied embeddings across stages: the last stage holds its own copy of the embedding as the output
            # layer (moe.model.build_model), trained like any weight and kept equal by finalize_model_grads
            dense_params += counts.embedding // tp
    expert_params = moe_layers * counts.experts_per_layer // (ep * etp)

    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    a = 2 if inputs.precision == "bf16" else 4  # bytes of an activation / logit in the run's precision
    attention_act = a * (2 * h + (nq + 2 * nkv) * d + nq * d) + 4 * nq
    moe_act = a * 2 * h + 4 * arch.num_experts + arch.num_experts_per_tok * a * (h + 3 * arch.moe_intermediate_size)
    dense_act = a * (3 * h + 3 * arch.intermediate_size)
    recomputed_per_token = 0  # live again, for one layer at a time, while that layer is recomputed
    if inputs.recompute == "selective":
        moe_recomputed = moe_act - a * 2 * h
        attention_act, moe_act = attention_act - 4 * nq, a * 2 * h
        recomputed_per_token = moe_recomputed if moe_layers else 0
    elif inputs.recompute == "full":
        recomputed_per_token = attention_act + (moe_act if moe_layers else dense_act)
        attention_act, moe_act, dense_act = a * h, 0, 0
    per_token_stage = layers * attention_act + moe_layers * moe_act + dense_layers * dense_act
    in_flight = min(pp, inputs.micro_batches_per_update or inputs.num_micro_batches) if first else 1
    tokens = inputs.micro_batch_tokens
    activations = (per_token_stage * in_flight + recomputed_per_token) * tokens / tp

    precision = inputs.precision
    weight_bytes, optimizer_bytes = PRECISION_BYTES[precision]
    terms = {
        f"weights ({precision})": weight_bytes * (dense_params + expert_params),
        **({f"reference model weights ({precision}, frozen, KL)": weight_bytes * (dense_params + expert_params)}
           if inputs.reference_model else {}),
        "gradients (fp32 main grad)": 4 * (dense_params + expert_params),
        _OPTIMIZER_LABEL[precision]: optimizer_bytes * dense_params / dp + optimizer_bytes * expert_params / expert_dp,
        "activations": activations,
    }
    if last and inputs.logprob_path == "hidden":
        vocab_local = arch.vocab_size / tp
        terms[f"log-prob: LM-head input ({precision}, full sequence)"] = a * h * tokens
        terms[f"log-prob: one chunk's logits ({precision})"] = a * vocab_local * min(inputs.logprob_chunk_tokens,
                                                                                     tokens)
        terms["log-prob: fused kernel stats"] = (16 if tp == 1 else 32) * tokens
    elif last:
        vocab_local = arch.vocab_size / tp
        terms[f"log-prob: logits ({precision})"] = a * vocab_local * tokens
        if inputs.fused_logprob:
            terms["log-prob: fused kernel stats"] = 16 * tokens
        else:
            terms["log-prob: fp32 log-softmax + its gradient"] = 8 * vocab_local * tokens
    if inputs.routing_replay:
        id_bytes = 1 if arch.num_experts <= 256 else 2
        terms["routing replay buffer"] = tokens * inputs.num_micro_batches * moe_layers * arch.num_experts_per_tok * id_bytes
    return terms


def plan_memory(arch: Qwen3MoeArchitecture, inputs: PlanInputs) -> MemoryPlan:
    """The per-GPU memory of the busiest rank; raises LayoutError if the layout does not divide."""
    layout = inputs.shape.layout  # the shape raises a named LayoutError where the layout does not divide the world
    layout.check_model(arch.num_hidden_layers, arch.num_experts, arch.num_attention_heads,
                       arch.num_key_value_heads, arch.vocab_size)
    if layout.pipeline_parallel == 1:
        candidates = {"only": _stage_terms(arch, inputs, True, True)}
    else:
        candidates = {"first": _stage_terms(arch, inputs, True, False),
                      "last": _stage_terms(arch, inputs, False, True)}
    stage, terms = max(candidates.items(), key=lambda kv: sum(kv[1].values()))
    terms_gib = {name: value / GIB for name, value in terms.items()}
    return MemoryPlan(terms_gib=terms_gib, stage=stage, total_gib=sum(terms_gib.values()),
                      capacity_gib=inputs.gpu_memory_gib - inputs.reserve_gib)


def require_fit(plan: MemoryPlan) -> MemoryPlan:
    if not plan.fits:
        largest = plan.largest_term
        raise PlanError(
            f"the recipe needs {plan.total_gib:.1f} GiB per GPU on the {plan.stage} stage but "
            f"{plan.capacity_gib:.1f} GiB are usable; the largest term is {largest!r} at "
            f"{plan.terms_gib[largest]:.1f} GiB\n{plan.table()}"
        )
    return plan


__all__ = ["GIB", "PRECISION_BYTES", "LayoutError", "MemoryPlan", "PlanError", "PlanInputs", "ParameterCounts", "parameter_counts",
           "plan_memory", "require_fit"]
