"""Activation recompute (`model.recompute`): selective (core attention + MoE layers) and full (every layer)
recompute what they dropped in backward, and give exactly the gradients of no recompute (float32 on the CPU:
the recomputed forward runs the same kernels on the same inputs, so bit for bit)."""

from __future__ import annotations

import pytest
import torch

from devices import megatron_groups
from helpers import tiny_arch
from multiprocess import run_distributed

ARCH = tiny_arch("mixed", vocab_size=48, num_hidden_layers=3,
                 max_position_embeddings=40960)  # Qwen3MoeArchitecture's default length


def _body(rank, world_size, seed):
    from moe.implementation import ModelImplementation
    from moe.model import build_model, forward_logits
    from moe.sharding import load_full_state_dict

    megatron_groups(seed)
    arch = ARCH
    gen = torch.Generator().manual_seed(seed)
    tokens_BS = torch.randint(0, arch.vocab_size, (2, 11), generator=gen)
    grad_weights = None
    full = None
    out = {}
    for recompute in ("none", "selective", "full"):
        model = build_model(arch, implementation=ModelImplementation(recompute=recompute))
        model.train()
        if full is None:
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
        load_full_state_dict(model, full)
        calls = {"core_attention": 0, "experts": 0, "dense_mlp": 0}

        def count(kind):
            def hook(module, args, output):
                calls[kind] += 1
            return hook

        for layer in model.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(count("core_attention"))
            experts = getattr(layer.mlp, "experts", None)
            (experts or layer.mlp).register_forward_hook(count("experts" if experts is not None else "dense_mlp"))
        logits = forward_logits(model, tokens_BS)
        if grad_weights is None:
            grad_weights = torch.randn(logits.shape, generator=gen)
        (logits * grad_weights).sum().backward()
        out[recompute] = dict(logits=logits.detach(), calls=dict(calls),
                              grads={n: p.grad.clone() for n, p in model.named_parameters()},
                              granularity=model.config.recompute_granularity)
    return out


@pytest.fixture(scope="module")
def results():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return seed, run_distributed(_body, world_size=1, args=(seed,), timeout_s=240)[0]


@pytest.mark.parametrize("recompute, granularity, calls", [
    ("none", None, {"core_attention": 3, "experts": 2, "dense_mlp": 1}),
    # core attention and the MoE layers run again in backward; the dense MLP does not
    ("selective", "selective", {"core_attention": 6, "experts": 4, "dense_mlp": 1}),
    ("full", "full", {"core_attention": 6, "experts": 4, "dense_mlp": 2}),
])
def test_recompute_runs_again_in_backward_and_gives_identical_gradients(results, recompute, granularity, calls):
    seed, out = results
    got, ref = out[recompute], out["none"]
    assert got["granularity"] == granularity
    assert got["calls"] == calls
    assert torch.equal(got["logits"], ref["logits"]), f"seed {seed}"
    assert got["grads"].keys() == ref["grads"].keys()
    for name, expected in ref["grads"].items():
        assert torch.equal(got["grads"][name], expected), f"seed {seed} {recompute}: gradient of {name} differs"


def test_recompute_key_is_validated():
    from megagspo.config import ConfigError, ModelConfig
    from moe.implementation import ImplementationError, ModelImplementation

    with pytest.raises(ConfigError, match="model.recompute = 'partial' is not valid; valid values: none, selective, full"):
        ModelConfig(recompute="partial")
    with pytest.raises(ConfigError, match="model.experts = 'loop'"):
        ModelConfig(experts="loop")
    with pytest.raises(ConfigError, match="model.attention = 'flash'"):
        ModelConfig(attention="flash")
    with pytest.raises(ImplementationError, match="model.recompute must be one of none, selective, full"):
        ModelImplementation(recompute="yes")
    assert ModelConfig().implementation() == ModelImplementation("grouped", "sdpa", "none")
