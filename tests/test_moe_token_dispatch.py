"""The fast all-to-all dispatcher (moe.token_dispatch, `ModelImplementation(dispatcher="fast")`) computes what
Megatron's MoEAlltoAllTokenDispatcher computes: the whole model's logits and every parameter's gradient equal
Megatron's bit for bit on the CPU in float32 (the identity chunk sort returns its input; the sum of each token's
routed copies adds them in scatter_add's order), and within one bf16 rounding of the sum in bfloat16 (the
reduction accumulates the k copies in float32 and rounds once, where scatter_add rounds after each add).
`sum_routed_copies` alone is checked against a float64 index_add reference, with gradients, on odd shapes.
The multi-rank layouts (EP = 2, TP = 2) run the fast dispatcher too, through every parity test of
tests/test_megatron_cpu.py (the default implementation)."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICES, megatron_groups
from helpers import tiny_arch
from multiprocess import run_distributed

ARCH = tiny_arch("moe", vocab_size=64, num_experts=6, num_experts_per_tok=3, router_aux_loss_coef=0.01)


def _reference_unpermute(permuted_PH, token_of_copy_P, num_tokens):
    out = torch.zeros(num_tokens, permuted_PH.shape[1], dtype=torch.float64, device=permuted_PH.device)
    return out.index_add_(0, token_of_copy_P, permuted_PH.double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("num_tokens,topk,hidden", [(1, 1, 8), (7, 3, 24), (37, 8, 40)])
def test_sum_routed_copies_equals_index_add(device, dtype, atol, num_tokens, topk, hidden):
    from moe.token_dispatch import sum_routed_copies

    gen = torch.Generator().manual_seed(num_tokens * 100 + topk)
    num_experts = topk + 3
    # Megatron's permutation: expert-major, tokens ascending within each expert, k distinct experts per token
    routing_NE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    for n in range(num_tokens):
        routing_NE[n, torch.randperm(num_experts, generator=gen)[:topk]] = True
    token_of_copy_P = torch.arange(num_tokens).unsqueeze(0).expand(num_experts, -1).masked_select(
        routing_NE.T.contiguous()).to(device)
    permuted_PH = torch.randn(num_tokens * topk, hidden, generator=gen).to(device, dtype).requires_grad_(True)
    out_NH = sum_routed_copies(permuted_PH, token_of_copy_P, num_tokens, topk)
    assert out_NH.dtype == dtype and out_NH.shape == (num_tokens, hidden)
    torch.testing.assert_close(out_NH.double(), _reference_unpermute(permuted_PH.detach(), token_of_copy_P,
                                                                     num_tokens), rtol=0, atol=atol * topk)
    grad_NH = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    (grad_PH,) = torch.autograd.grad(out_NH, permuted_PH, grad_NH)
    assert torch.equal(grad_PH, grad_NH[token_of_copy_P])  # the gradient of a sum is a copy: exact


def test_sum_routed_copies_refuses_a_dropped_token():
    from moe.token_dispatch import sum_routed_copies

    with pytest.raises(ValueError, match="5 routed copies for 3 tokens at top-2"):
        sum_routed_copies(torch.zeros(5, 4), torch.tensor([0, 1, 2, 0, 1]), 3, 2)


def test_chunk_order_is_identity():
    from moe.token_dispatch import chunk_order_is_identity

    assert chunk_order_is_identity(torch.arange(6))
    assert not chunk_order_is_identity(torch.tensor([0, 2, 1, 3]))
    assert not chunk_order_is_identity(torch.arange(4).reshape(2, 2).T.ravel())


def _model_body(rank, world_size, seed):
    from moe.implementation import ModelImplementation
    from moe.model import build_model, forward_logits
    from moe.sharding import load_full_state_dict
    from moe.token_dispatch import FastAlltoAllTokenDispatcher

    megatron_groups(seed)
    arch = ARCH
    gen = torch.Generator().manual_seed(seed)
    tokens_BS = torch.randint(0, arch.vocab_size, (3, 11), generator=gen)
    out = {}
    weights = None
    for dtype in (torch.float32, torch.bfloat16):
        for dispatcher in ("megatron", "fast"):
            model = build_model(arch, params_dtype=dtype, use_transformer_engine=False,
                                implementation=ModelImplementation(dispatcher=dispatcher))
            if weights is None:
                weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            load_full_state_dict(model, {n: t.to(dtype) for n, t in weights.items()})
            logits = forward_logits(model, tokens_BS)
            logits.float().square().mean().backward()
            out[(dispatcher, dtype)] = {
                "logits": logits.detach().float(),
                "grads": {n: p.grad.float() for n, p in model.named_parameters()},
                "fast": [isinstance(layer.mlp.token_dispatcher, FastAlltoAllTokenDispatcher)
                         for layer in model.decoder.layers]}
    return out


def test_fast_dispatcher_equals_megatron_in_the_whole_model():
    out = run_distributed(_model_body, 1, args=(5,))[0]
    for dtype in (torch.float32, torch.bfloat16):
        fast, megatron = out[("fast", dtype)], out[("megatron", dtype)]
        assert fast["fast"] == [True, True] and megatron["fast"] == [False, False]
        if dtype == torch.float32:
            assert torch.equal(fast["logits"], megatron["logits"])
            for name, grad in megatron["grads"].items():
                assert torch.equal(fast["grads"][name], grad), name
        else:
            # one bf16 rounding of each layer's combined output apart: logits within a few bf16 ulps
            scale = float(megatron["logits"].abs().max())
            torch.testing.assert_close(fast["logits"], megatron["logits"], rtol=0, atol=4 * 2 ** -8 * scale)
