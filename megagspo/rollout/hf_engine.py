"""The embedded rollout engine: transformers' Qwen3MoeForCausalLM, sampling with its KV cache, fed the
weights exported from Megatron after every update, bucket by bucket (weight_sync.HFParamWriter).

Prompts are generated in groups of equal length, so no left padding (and no position-id ambiguity) is
ever needed. Legend as in base.py; V the model's vocabulary.

Rollout log-probs are taken step by step (`_StepLogProbs`): each decoding step's logits for the last position
([R, V], the model's dtype) are kept from the model's forward until `generate` has sampled that step's token,
then turned into that token's log-prob (fp32 log-softmax over V, the same formula on the same logits as
`generate`'s `output_logits` gave the former path) and dropped. Extra memory: one step's [R, V], never the
[R, T, V] of all steps (3.1 GiB at 4 x 400 tokens at Qwen3's V = 151,936; docs/benchmarks.md).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, Optional, Sequence

import torch

from moe.device import model_device
from moe.hf_config import hf_config_from_architecture

from .base import RolloutEngine, RolloutOutput, SamplingParams, WeightSwitch, drain, register_engine
from .weight_sync import HFParamWriter


def hf_config_for(arch, tokenizer, dtype: torch.dtype = torch.float32):
    """transformers.Qwen3MoeConfig for a moe.architecture.Qwen3MoeArchitecture (moe.hf_config's mapping)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**hf_config_from_architecture(arch, dtype=str(dtype).removeprefix("torch.")))
    config.pad_token_id = tokenizer.pad_id
    config.eos_token_id = list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else tokenizer.eos_id
    config.bos_token_id = tokenizer.bos_id
    return config


def _seeded_sampling(sampling: SamplingParams):
    """The warpers `do_sample=True` would apply (temperature, top-p), then the Gumbel-max draw from
    sampling.generator: greedy decoding over these scores is a sample."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    processors = []
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))
    return LogitsProcessorList([*processors, _GumbelMax(sampling.generator)])


class _GumbelMax:
    """A logits processor that makes greedy decoding a sample: argmax(scores + Gumbel noise) is distributed as
    softmax(scores) (the Gumbel-max trick), the noise drawn from `generator`. After the temperature and top-p
    warpers it samples exactly what `do_sample=True` samples, from the given generator instead of the global
    one (which Megatron's RNG tracker saves and restores around its forward: a generation on another thread
    drawing from it would be overwritten)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, input_ids, scores):
        uniform = torch.rand(scores.shape, generator=self.generator, device=scores.device, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
        return scores.float() + gumbel


class _StepLogProbs:
    """The log-prob of each sampled token, one decoding step at a time, without keeping any step's logits.

    `generate` runs, per step: the model's forward (logits of the last position) -> logits processors ->
    sampling -> the stopping criteria, which see input_ids with the new token appended. A forward hook on the
    model keeps that step's logits_RV (a view, the model's dtype); `criteria` (a StoppingCriteria that never
    stops anything) then gathers log_softmax(logits_RV in fp32)[sampled] and lets the logits go. These are the
    raw logits `generate` itself would return as `output_logits` (it upcasts them to fp32 the same way), so
    the numbers equal the former log_softmax over the stacked [R, T, V]: the same per-row fp32 reduction.
    Holds one step's [R, V] logits plus an fp32 [R, V] transient, and the [R, T] fp32 log-probs."""

    def __init__(self) -> None:
        self.active = False
        self._logits_RV: Optional[torch.Tensor] = None
        self._logp_RT: Optional[torch.Tensor] = None  # fp32, written one column per step
        self.steps = 0

    def start(self, rows: int, max_steps: int, device) -> None:
        """Before `generate`: one preallocated [R, T] buffer (no per-step tensor outlives its step: on the CPU,
        small long-lived blocks between the step-sized ones fragment the heap, measured +0.5 GiB RSS at 8 x 512
        tokens, V = 151,936)."""
        self.active, self._logits_RV, self.steps = True, None, 0
        self._logp_RT = torch.zeros((rows, max_steps + 1), dtype=torch.float32, device=device)

    def stop(self) -> None:
        self.active, self._logits_RV = False, None

    def hook(self, module, inputs, output) -> None:
        if self.active:
            self._logits_RV = output.logits[:, -1]

    def on_token(self, input_ids_RP: torch.Tensor) -> None:
        if self._logits_RV is None:
            raise RuntimeError("HF engine: a token was sampled without a forward pass seen by the log-prob hook "
                               "(a transformers decoding path this engine does not know)")
        token_R1 = input_ids_RP[:, -1:].to(self._logits_RV.device)
        logp_RV = torch.log_softmax(self._logits_RV.float(), dim=-1)
        self._logits_RV = None
        if self.steps == self._logp_RT.shape[1]:  # a deferred stop check ran past the planned steps
            self._logp_RT = torch.cat([self._logp_RT, torch.zeros_like(self._logp_RT[:, :8])], dim=1)
        torch.gather(logp_RV, -1, token_R1, out=self._logp_RT[:, self.steps:self.steps + 1])
        self.steps += 1
        del logp_RV

    def logp_RT(self, steps: int) -> torch.Tensor:
        """[R, steps] fp32 on the CPU (a deferred stop check may have run steps `generate` then undid)."""
        if self.steps < steps:
            raise RuntimeError(f"HF engine: {self.steps} log-prob steps recorded for {steps} tokens")
        out = self._logp_RT[:, :steps].cpu()
        self._logp_RT = None
        return out

    def criteria(self):
        """A StoppingCriteriaList for `generate`: records each step's log-probs, never stops a row."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        recorder = self

        class _RecordLogProbs(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                recorder.on_token(input_ids)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([_RecordLogProbs()])


class _StopForWeights:
    """A stopping criterion (partial rollouts): stops every row once the switch has newer weights; `fired` says
    it did. Any other criterion that stops a row (eos, length) leaves `fired` as it is."""

    def __init__(self, switch: Optional[WeightSwitch]) -> None:
        self.switch, self.fired = switch, False

    def __call__(self, input_ids, scores, **kwargs):
        self.fired = self.fired or bool(self.switch.pending())
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


ENGINE_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_sim": torch.bfloat16}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_round(w: torch.Tensor) -> torch.Tensor:
    """w through float8_e4m3fn with one scale per tensor (amax / 448, the per-tensor scaling of FP8 inference),
    back in w's dtype: the weights an FP8 engine computes with. A tensor of zeros stays zeros."""
    scale = w.detach().abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def fp8_round_moe_weights(model) -> None:
    """rollout.engine_dtype = fp8_sim: every router (mlp.gate.weight [E, H]) and every expert's matrices (one slice
    of the fused gate_up_proj [E, 2I, H] / down_proj [E, H, I] each: per-tensor scales as the trainer's per-expert
    tensors) rounded through float8_e4m3fn in place. Attention, norms, embeddings and the LM head keep bf16."""
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.data.copy_(fp8_round(param.data))
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            for e in range(param.shape[0]):
                param.data[e].copy_(fp8_round(param.data[e]))


def engine_dtype(dtype, device: torch.device, precision: str = "auto") -> torch.dtype:
    """The embedded engine's parameter dtype. `precision` (rollout.engine_dtype) fp32 / bf16 / fp16 / fp8_sim
    (bf16 compute) on any device; auto: the policy's (`dtype`: a torch dtype or "fp32"/"bf16", None = fp32) on a
    GPU, always fp32 on the CPU, where bf16 matmuls are slow and the golden CPU numbers are fp32."""
    if precision != "auto":
        if precision not in ENGINE_PRECISIONS:
            raise ValueError(f"HF engine precision {precision!r} is not valid; valid values: auto, "
                             f"{', '.join(ENGINE_PRECISIONS)}")
        return ENGINE_PRECISIONS[precision]

    """The embedded engine's parameter dtype: the policy's (`dtype`: a torch dtype or "fp32"/"bf16", None =
    fp32) on a GPU; always fp32 on the CPU, where bf16 matmuls are slow and the golden CPU numbers are fp32."""
    if dtype is None or device.type != "cuda":
        return torch.float32
    named = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    resolved = named.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16):
        raise ValueError(f"HF engine dtype {dtype!r} is not valid; valid values: fp32, bf16 (or those torch dtypes)")
    return resolved


@register_engine("hf")
class HFRolloutEngine(RolloutEngine):
    """`dtype`: the policy's parameter precision; the engine's model takes it on a GPU (bf16 policy -> bf16
    engine) and stays fp32 on the CPU (`engine_dtype`). Default fp32. `precision` (rollout.engine_dtype) sets the
    engine's own instead, on any device; fp8_sim also rounds its router and expert weights through FP8 each time
    it loads weights."""

    def __init__(self, arch, tokenizer, record_routes: bool = True, dtype=None, precision: str = "auto") -> None:
        from transformers import Qwen3MoeForCausalLM

        self.arch = arch
        self.tokenizer = tokenizer
        # the trainer's device: this process's GPU when the policy runs on CUDA (MEGAGSPO_DEVICE), else the CPU
        self.device = model_device()
        self.dtype = engine_dtype(dtype, self.device, precision)
        self.fp8_sim = precision == "fp8_sim"
        config = hf_config_for(arch, tokenizer, self.dtype)
        self.model = Qwen3MoeForCausalLM(config).eval().to(self.device, self.dtype)
        self._logp = _StepLogProbs()
        self.model.register_forward_hook(self._logp.hook)
        self.record_routes = record_routes
        self._routes: Dict[int, list] = defaultdict(list)
        self._gates = []
        for name, module in self.model.named_modules():
            if name.endswith("mlp.gate"):
                layer = len(self._gates)
                self._gates.append(name)
                module.register_forward_hook(self._hook(layer))
        self._recording = False

    def _hook(self, layer: int):
        def fn(module, inputs, output):
            if self._recording:
                self._routes[layer].append(output[2].detach())  # (logits, scores, indices[tokens, K])
        return fn

    @torch.no_grad()
    def update_weights_from_buckets(self, buckets: Iterable[Dict[str, torch.Tensor]]) -> None:
        """Copy a stream of full-Megatron-state buckets into the model, one bucket at a time (HFParamWriter:
        each Megatron tensor's row segments straight into their slices of the HF parameters, e.g. one expert of
        the fused `gate_up_proj`, cast to the model's dtype; no HF state dict is built). Raises, after draining
        the stream, when a tensor is unknown or misshapen, or when the stream did not write every parameter
        exactly once. A rank whose stream does not receive (`buckets.receive` False: it never generates) only
        drains it; its model keeps the weights it had."""
        it = iter(buckets)
        if not getattr(buckets, "receive", True):
            drain(it)
            return
        try:
            writer = HFParamWriter(self.model, self.arch)
            for bucket in it:
                writer.write(bucket)
                del bucket
            writer.finish()
            if self.fp8_sim:  # the trainer's exact weights arrived (cast to bf16): the FP8 engine's rounding on load
                fp8_round_moe_weights(self.model)
        finally:
            drain(it)  # no-op after a full pass; after a failure, the peers' collectives still complete

    @torch.no_grad()
    def seeded_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 switch: Optional[WeightSwitch] = None) -> RolloutOutput:
        """G = n samples of each prompt. With `switch` (partial rollouts), newer weights that arrive between two
        decoding steps stop the unfinished responses; they continue from their prefix (prompt + tokens so far,
        prefilled again) under the new weights, and every token carries the version that sampled it."""
        tok = self.tokenizer
        num = len(prompts) * n
        max_new = sampling.max_new_tokens
        max_prompt = max(len(p) for p in prompts)
        response_RL = torch.full((num, max_new), tok.pad_id, dtype=torch.long)
        mask_RL = torch.zeros((num, max_new), dtype=torch.bool)
        logp_RL = torch.zeros((num, max_new), dtype=torch.float32)
        version_RL = torch.zeros((num, max_new), dtype=torch.long) if switch is not None else None
        n_layers = len(self._gates)
        routes = None
        if self.record_routes and n_layers:
            routes = torch.full((num, max_prompt + max_new - 1, n_layers, self.arch.num_experts_per_tok), -1,
                                dtype=torch.int16)
        seeded = sampling.generator is not None and not sampling.greedy
        processors = _seeded_sampling(sampling) if seeded else None
        by_len: Dict[int, list] = defaultdict(list)
        for i, p in enumerate(prompts):
            by_len[len(p)].append(i)
        eos_T = torch.tensor(tok.eos_ids, dtype=torch.long)
        for plen, idx in by_len.items():
            rows = torch.tensor([r for i in idx for r in range(i * n, i * n + n)])
            input_ids = torch.tensor([list(prompts[i]) for i in idx for _ in range(n)], dtype=torch.long,
                                     device=self.device)
            done = 0  # tokens generated so far by every row still in `rows` (they decode in lockstep)
            while len(rows):
                if switch is not None and switch.pending():  # newer weights: load them before the next token
                    switch.apply(self)
                new_RT, lp_RT, r_chunks, interrupted = self._decode(input_ids, max_new - done, sampling, processors,
                                                                    switch, routes is not None)
                steps = new_RT.shape[1]
                is_eos = torch.isin(new_RT, eos_T.to(new_RT.dtype))
                # a token is part of the response up to and including the first eos (any of the stop tokens)
                before_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0
                span = slice(done, done + steps)
                response_RL[rows, span] = torch.where(before_eos, new_RT, torch.full_like(new_RT, tok.pad_id))
                mask_RL[rows, span] = before_eos
                logp_RL[rows, span] = torch.where(before_eos, lp_RT, torch.zeros_like(lp_RT))
                if version_RL is not None:
                    version_RL[rows, span] = torch.where(before_eos, switch.version, 0)
                if routes is not None:  # a resumed row's routes: those of the forward that computed its last token
                    for layer in range(n_layers):
                        r_RPK = torch.cat([c.reshape(len(rows), -1, c.shape[-1]) for c in r_chunks[layer]], dim=1)
                        width = min(r_RPK.shape[1], input_ids.shape[1] + steps - 1)
                        routes[rows, :width, layer] = r_RPK[:, :width].to("cpu", torch.int16)
                done += steps
                if not interrupted or done >= max_new:
                    break
                going = ~is_eos.any(1)  # rows without a stop token continue from their prefix
                rows = rows[going]
                input_ids = torch.cat([input_ids, new_RT.to(self.device)], dim=1)[going.to(self.device)]
        prompt_ids = [list(p) for p in prompts for _ in range(n)]
        return RolloutOutput(prompt_ids, response_RL, mask_RL, logp_RL, routes, version_RL)

    def _decode(self, input_ids: torch.Tensor, max_new: int, sampling: SamplingParams, processors,
                switch: Optional[WeightSwitch], record: bool):
        """One `generate` call over rows of equal length: -> (new tokens [R, T] on the CPU, their log-probs
        [R, T], the routes recorded per MoE layer, whether `switch` stopped it part-way)."""
        from transformers import GenerationConfig

        tok = self.tokenizer
        sample = not sampling.greedy and processors is None
        gen_cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None, top_k=None,
            pad_token_id=tok.pad_id, eos_token_id=list(tok.eos_ids), bos_token_id=tok.bos_id,
            return_dict_in_generate=True,
        )
        criteria = self._logp.criteria()
        stop = _StopForWeights(switch)
        if switch is not None:
            criteria.append(stop)
        self._routes.clear()
        self._recording = record
        self._logp.start(input_ids.shape[0], max_new, self.device)
        try:
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=gen_cfg, stopping_criteria=criteria,
                                      logits_processor=processors)
        finally:
            self._recording = False
            self._logp.stop()
        new_RT = out.sequences[:, input_ids.shape[1]:]
        lp_RT = self._logp.logp_RT(new_RT.shape[1])
        return new_RT.cpu(), lp_RT, dict(self._routes), stop.fired
