"""The embedded rollout engine: transformers' Qwen3MoeForCausalLM, sampling with its KV cache, fed the
weights exported from Megatron after every update, bucket by bucket (weight_sync.HFParamWriter).

Prompts are generated in groups of equal length, so no left padding (and no position-id ambiguity) is
ever needed. Legend as in base.py.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, Sequence

import torch

from .base import RolloutEngine, RolloutOutput, SamplingParams, drain, register_engine
from .weight_sync import HFParamWriter


def hf_config_for(arch, tokenizer):
    """transformers.Qwen3MoeConfig for a moe.architecture.Qwen3MoeArchitecture (moe.hf_config's mapping)."""
    from transformers import Qwen3MoeConfig

    from moe.hf_config import hf_config_from_architecture

    config = Qwen3MoeConfig(**hf_config_from_architecture(arch, dtype="float32"))
    config.pad_token_id = tokenizer.pad_id
    config.eos_token_id = list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else tokenizer.eos_id
    config.bos_token_id = tokenizer.bos_id
    return config


@register_engine("hf")
class HFRolloutEngine(RolloutEngine):
    def __init__(self, arch, tokenizer, record_routes: bool = True) -> None:
        from transformers import Qwen3MoeForCausalLM

        self.arch = arch
        self.tokenizer = tokenizer
        from moe.device import model_device

        # the trainer's device: this process's GPU when the policy runs on CUDA (MEGAGSPO_DEVICE), else the CPU
        self.device = model_device()
        self.model = Qwen3MoeForCausalLM(hf_config_for(arch, tokenizer)).eval().to(self.device)
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
        finally:
            drain(it)  # no-op after a full pass; after a failure, the peers' collectives still complete

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> RolloutOutput:
        from transformers import GenerationConfig

        tok = self.tokenizer
        num = len(prompts) * n
        max_new = sampling.max_new_tokens
        max_prompt = max(len(p) for p in prompts)
        response_RL = torch.full((num, max_new), tok.pad_id, dtype=torch.long)
        mask_RL = torch.zeros((num, max_new), dtype=torch.bool)
        logp_RL = torch.zeros((num, max_new), dtype=torch.float32)
        n_layers = len(self._gates)
        routes = None
        if self.record_routes and n_layers:
            routes = torch.full((num, max_prompt + max_new - 1, n_layers, self.arch.num_experts_per_tok), -1,
                                dtype=torch.int16)
        gen_cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None, top_k=None,
            pad_token_id=tok.pad_id, eos_token_id=list(tok.eos_ids), bos_token_id=tok.bos_id,
            output_logits=True, return_dict_in_generate=True,
        )
        by_len: Dict[int, list] = defaultdict(list)
        for i, p in enumerate(prompts):
            by_len[len(p)].append(i)
        for plen, idx in by_len.items():
            rows = torch.tensor([r for i in idx for r in range(i * n, i * n + n)])
            input_ids = torch.tensor([list(prompts[i]) for i in idx for _ in range(n)], dtype=torch.long,
                                     device=self.device)
            self._routes.clear()
            self._recording = routes is not None
            try:
                out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                          generation_config=gen_cfg)
            finally:
                self._recording = False
            new_RT = out.sequences[:, plen:]
            steps = new_RT.shape[1]
            logits_RTV = torch.stack(out.logits, dim=1).float()
            lp_RT = torch.log_softmax(logits_RTV, dim=-1).gather(-1, new_RT[..., None]).squeeze(-1).cpu()
            del logits_RTV
            new_RT = new_RT.cpu()  # the rollout's tensors go back to the trainer on the CPU
            is_eos = torch.isin(new_RT, torch.tensor(tok.eos_ids, dtype=new_RT.dtype))
            # a token is part of the response up to and including the first eos (any of the stop tokens)
            before_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0
            response_RL[rows, :steps] = torch.where(before_eos, new_RT, torch.full_like(new_RT, tok.pad_id))
            mask_RL[rows, :steps] = before_eos
            logp_RL[rows, :steps] = torch.where(before_eos, lp_RT, torch.zeros_like(lp_RT))
            if routes is not None:
                for layer in range(n_layers):
                    chunks = [c.reshape(len(rows), -1, c.shape[-1]) for c in self._routes[layer]]
                    r_RPK = torch.cat(chunks, dim=1)
                    width = min(r_RPK.shape[1], plen + steps - 1)
                    routes[rows, :width, layer] = r_RPK[:, :width].to("cpu", torch.int16)
        prompt_ids = [list(p) for p in prompts for _ in range(n)]
        return RolloutOutput(prompt_ids, response_RL, mask_RL, logp_RL, routes)
