"""SDPA core attention (moe.attention.SDPACoreAttention, `model.attention=sdpa`) equals Megatron's local
DotProductAttention: values and the gradients of q, k and v, causal (explicit mask, and the implicit
`is_causal` path that flash attention takes), GQA / MQA / MHA, right padding, odd shapes; and the whole model.

Tolerances. float32: rtol 1e-5, atol 2e-6 * max|reference| + 1e-7 (both are float32 softmax(q k^T) v, in a
different order). bfloat16: each path's error against the float32 reference on the same bf16 inputs; SDPA's
may be at most 2x DotProductAttention's own bf16 error plus one bf16 ulp of the largest value.
"""

from __future__ import annotations

import os

import pytest
import torch

from devices import megatron_groups
from helpers import scaled_close, tiny_arch
from multiprocess import run_distributed

CUDA_ENV = {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}

SEQ, BATCH, HEADS, DIM = 7, 3, 4, 8
LENGTHS = [7, 4, 1]  # right padding: row b holds LENGTHS[b] real tokens
RTOL, ATOL_SCALE = 1e-5, 2e-6
_close = scaled_close(rtol=RTOL, atol_scale=ATOL_SCALE)


def _masks():
    """Megatron's convention: True where attention is masked out."""
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    key_is_pad_BS = torch.arange(SEQ)[None, :] >= torch.tensor(LENGTHS)[:, None]
    return {"causal": causal, "causal_padding": causal | key_is_pad_BS[:, None, None, :]}


def _call(module, q, k, v, mask, grad):
    from moe.device import use_cuda

    device = "cuda" if use_cuda() else "cpu"
    q, k, v = (t.to(device).clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, None if mask is None else mask.to(device))
    (out.float() * grad.to(device)).sum().backward()
    return out.detach(), {"q": q.grad, "k": k.grad, "v": v.grad}


def _body(rank, world_size, seed):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe.architecture import transformer_config
    from moe.attention import SDPACoreAttention
    from moe.implementation import ModelImplementation
    from moe.model import build_model, forward_logits
    from moe.sharding import load_full_state_dict

    megatron_groups(seed)  # the CPU shim does nothing on a GPU host
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for groups in (HEADS, 2, 1):  # MHA, GQA, MQA
        for dtype in (torch.float32, torch.bfloat16):
            arch = tiny_arch("attention", num_attention_heads=HEADS, num_key_value_heads=groups, head_dim=DIM)
            config = transformer_config(arch, params_dtype=dtype)
            local = DotProductAttention(config, 1, AttnMaskType.causal, "self")
            sdpa = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
            q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen)
            k = torch.randn(SEQ, BATCH, groups, DIM, generator=gen)
            v = torch.randn(SEQ, BATCH, groups, DIM, generator=gen)
            grad = torch.randn(SEQ, BATCH, HEADS * DIM, generator=gen)
            lowp = [t.to(dtype) for t in (q, k, v)]
            for mask_name, mask in _masks().items():
                key = (groups, str(dtype).split(".")[-1], mask_name)
                out[key + ("local",)] = _call(local, *lowp, mask, grad)
                out[key + ("sdpa",)] = _call(sdpa, *lowp, mask, grad)
                # float32 reference on the same (rounded) inputs
                ref_config = transformer_config(arch)
                out[key + ("reference",)] = _call(DotProductAttention(ref_config, 1, AttnMaskType.causal, "self"),
                                                  *(t.float() for t in lowp), mask, grad)
            # the flash-eligible path: no mask, is_causal
            out[(groups, str(dtype).split(".")[-1], "implicit_causal", "sdpa")] = _call(sdpa, *lowp, None, grad)
    # whole model: local vs SDPA attention (grouped experts in both), logits and every gradient
    arch = tiny_arch("moe", vocab_size=48, max_position_embeddings=40960)  # Qwen3MoeArchitecture's default length
    tokens_BS = torch.randint(0, arch.vocab_size, (2, 9), generator=gen)
    full = None
    for attention in ("local", "sdpa"):
        model = build_model(arch, implementation=ModelImplementation(attention=attention), use_transformer_engine=False)
        if full is None:
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
        load_full_state_dict(model, full)
        logits = forward_logits(model, tokens_BS.to(next(model.parameters()).device))
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)).to(logits.device)
        (logits * weights).sum().backward()
        out[("model", attention)] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                                     type(model.decoder.layers[0].self_attention.core_attention).__name__)
    return out


@pytest.fixture(scope="module")
def results():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return seed, run_distributed(_body, world_size=1, args=(seed,), timeout_s=240)[0]


@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["causal", "causal_padding"])
def test_sdpa_equals_local_attention_in_float32(results, groups, mask):
    seed, out = results
    ref_out, ref_grads = out[(groups, "float32", mask, "local")]
    got_out, got_grads = out[(groups, "float32", mask, "sdpa")]
    _close(got_out, ref_out, f"seed {seed} output")
    for name in ("q", "k", "v"):
        _close(got_grads[name], ref_grads[name], f"seed {seed} grad {name}")
    if mask == "causal":  # no mask at all: SDPA's is_causal (what flash attention runs on CUDA)
        got_out, got_grads = out[(groups, "float32", "implicit_causal", "sdpa")]
        _close(got_out, ref_out, f"seed {seed} implicit causal output")
        for name in ("q", "k", "v"):
            _close(got_grads[name], ref_grads[name], f"seed {seed} implicit causal grad {name}")


@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["causal", "causal_padding"])
def test_sdpa_bf16_error_is_within_twice_local(results, groups, mask):
    seed, out = results
    ref_out, ref_grads = out[(groups, "bfloat16", mask, "reference")]
    local_out, local_grads = out[(groups, "bfloat16", mask, "local")]
    got_out, got_grads = out[(groups, "bfloat16", mask, "sdpa")]
    pairs = [("output", got_out, local_out, ref_out)] + [
        (n, got_grads[n], local_grads[n], ref_grads[n]) for n in ("q", "k", "v")]
    for name, got, local, ref in pairs:
        ulp = 2.0**-8 * float(ref.abs().max())
        got_err = float((got.float() - ref).abs().max())
        local_err = float((local.float() - ref).abs().max())
        assert got_err <= 2 * local_err + ulp, f"seed {seed} {name}: sdpa {got_err:.3g} vs local {local_err:.3g}"


def test_whole_model_sdpa_equals_local_attention(results):
    seed, out = results
    ref_logits, ref_grads, ref_type = out[("model", "local")]
    logits, grads, got_type = out[("model", "sdpa")]
    assert (ref_type, got_type) == ("DotProductAttention", "SDPACoreAttention")
    _close(logits, ref_logits, f"seed {seed} logits")
    for name, expected in ref_grads.items():
        _close(grads[name], expected, f"seed {seed} grad {name}")


@pytest.mark.gpu
def test_sdpa_equals_local_attention_on_cuda():
    """The same checks on a GPU, where SDPA runs flash attention for the unmasked causal bf16 case."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    result = (seed, run_distributed(_body, world_size=1, args=(seed,), timeout_s=300, env=CUDA_ENV)[0])
    for groups in (HEADS, 2, 1):
        for mask in ("causal", "causal_padding"):
            test_sdpa_equals_local_attention_in_float32(result, groups, mask)
            test_sdpa_bf16_error_is_within_twice_local(result, groups, mask)
    test_whole_model_sdpa_equals_local_attention(result)
