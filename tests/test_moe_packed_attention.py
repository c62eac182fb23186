"""Packed sequences (THD, cu_seqlens) in the model equal the padded batch: SDPACoreAttention on a packed stream
against causal SDPA row by row (values and the gradients of q, k, v; MHA / GQA / MQA; odd lengths, a
one-token sequence), and the whole model (moe.model.forward_logits with `PackedSequences`: RoPE restarting per
sequence, attention kept within each sequence, MoE routing per token, the router aux loss over the same real
tokens) against the right-padded [B, S] batch with its padding masked: logits at every real position and every
parameter gradient. On CUDA the packed path is torch's variable-length flash attention (bf16).

Tolerances (one table): float32: rtol 1e-5, atol 2e-6 * max|reference| + 1e-7 (the same float32 math in a
different order). bfloat16: each path's error against the float32 reference on the same rounded inputs: the
packed path's may be at most 2x the padded path's own bf16 error plus one bf16 ulp of the largest value.
"""

from __future__ import annotations

import os

import pytest
import torch

from devices import megatron_groups
from helpers import assert_close_scaled, fresh_seed, tiny_arch
from multiprocess import run_distributed

CUDA_ENV = {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
HEADS, DIM = 4, 8
LENGTHS = [5, 1, 7, 3, 5, 1, 5]  # repeated lengths: one batched SDPA call per length
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol_scale=2e-6)}


def _padded_causal(q_TND, k_TGD, v_TGD, lengths, scale):
    """Reference: each sequence through causal SDPA on its own rows of a padded batch."""
    outs, start = [], 0
    for n in lengths:
        q, k, v = (x[start:start + n].transpose(0, 1)[None] for x in (q_TND, k_TGD, v_TGD))
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))
        start += n
    return torch.cat(outs).reshape(q_TND.shape[0], -1)


def _run(fn, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    (out.float() * grad).sum().backward()
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def _attention_body(rank, world_size, seed):
    from megatron.core.transformer.enums import AttnMaskType

    from moe.architecture import transformer_config
    from moe.attention import SDPACoreAttention
    from moe.device import use_cuda
    from moe.model import PackedSequences

    megatron_groups()
    device = "cuda" if use_cuda() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    packed = PackedSequences.from_lengths(LENGTHS, device=device).megatron_params()
    out = {}
    for groups in (HEADS, 2, 1):
        arch = tiny_arch("attention", num_attention_heads=HEADS, num_key_value_heads=groups, head_dim=DIM)
        module = SDPACoreAttention(transformer_config(arch), 1, AttnMaskType.causal, "self")
        q = torch.randn(total, HEADS, DIM, generator=gen).to(device)
        k = torch.randn(total, groups, DIM, generator=gen).to(device)
        v = torch.randn(total, groups, DIM, generator=gen).to(device)
        grad = torch.randn(total, HEADS * DIM, generator=gen).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            lowp = [t.to(dtype) for t in (q, k, v)]
            name = (groups, str(dtype).split(".")[-1])
            out[name + ("packed",)] = _run(lambda a, b, c: module(a, b, c, None, packed_seq_params=packed),
                                           *lowp, grad)
            out[name + ("padded",)] = _run(lambda a, b, c: _padded_causal(a, b, c, LENGTHS, module.softmax_scale),
                                           *lowp, grad)
            out[name + ("reference",)] = _run(
                lambda a, b, c: _padded_causal(a.float(), b.float(), c.float(), LENGTHS, module.softmax_scale),
                *lowp, grad)
    return {key: (o.cpu(), [g.cpu() for g in gs]) for key, (o, gs) in out.items()}


@pytest.fixture(scope="module")
def attention_results():
    seed = fresh_seed()
    return seed, run_distributed(_attention_body, world_size=1, args=(seed,), timeout_s=240)[0]


def _check_attention(seed, out, groups):
    got_out, got_grads = out[(groups, "float32", "packed")]
    ref_out, ref_grads = out[(groups, "float32", "padded")]
    assert_close_scaled(got_out, ref_out, f"seed {seed} output", **TOLERANCE[torch.float32])
    for name, got, ref in zip("qkv", got_grads, ref_grads):
        assert ref.abs().max() > 0
        assert_close_scaled(got, ref, f"seed {seed} grad {name}", **TOLERANCE[torch.float32])
    for what, i in (("output", None), ("q", 0), ("k", 1), ("v", 2)):
        pick = (lambda r: r[0]) if i is None else (lambda r, i=i: r[1][i])
        ref = pick(out[(groups, "bfloat16", "reference")])
        ulp = 2.0**-8 * float(ref.abs().max())
        packed_err = float((pick(out[(groups, "bfloat16", "packed")]) - ref).abs().max())
        padded_err = float((pick(out[(groups, "bfloat16", "padded")]) - ref).abs().max())
        assert packed_err <= 2 * padded_err + ulp, f"seed {seed} bf16 {what}: {packed_err:.3g} vs {padded_err:.3g}"


@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa", "mqa"])
def test_packed_attention_equals_causal_attention_per_sequence(attention_results, groups):
    seed, out = attention_results
    _check_attention(seed, out, groups)


def _model_body(rank, world_size, seed):
    from moe.implementation import ModelImplementation
    from moe.model import PackedSequences, build_model, forward_logits

    megatron_groups()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    arch = tiny_arch("moe", vocab_size=48, router_aux_loss_coef=0.01,
                     max_position_embeddings=40960)  # Qwen3MoeArchitecture's default length
    model = build_model(arch, implementation=ModelImplementation(attention="sdpa"), use_transformer_engine=False)
    device = next(model.parameters()).device
    lengths = [9, 4, 1, 6, 4]
    rows = [torch.randint(0, arch.vocab_size, (n,), generator=gen) for n in lengths]
    weights = [torch.randn(n, arch.vocab_size, generator=gen) for n in lengths]
    width = max(lengths)
    padded_BS = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        padded_BS[b, :len(r)] = r
    pad_BS = torch.arange(width)[None] >= torch.tensor(lengths)[:, None]

    def grads():
        out = {n: p.grad.clone().cpu() for n, p in model.named_parameters()}
        model.zero_grad()
        return out

    logits_BSV = forward_logits(model, padded_BS.to(device), padding_mask_BS=pad_BS.to(device))
    sum(((logits_BSV[b, :n].float().cpu() * w).sum() for b, (n, w) in enumerate(zip(lengths, weights)))).backward()
    padded = ([logits_BSV[b, :n].detach().cpu() for b, n in enumerate(lengths)], grads())
    packed_in = PackedSequences.from_lengths(lengths, device=device)
    logits_1TV = forward_logits(model, torch.cat(rows)[None].to(device), packed=packed_in)
    (logits_1TV[0].float().cpu() * torch.cat(weights)).sum().backward()
    packed = (list(logits_1TV[0].detach().cpu().split(lengths)), grads())
    return padded, packed, packed_in.position_ids_1T().cpu()


def test_packed_model_equals_the_padded_batch():
    """Logits of every real token and every parameter gradient (the router aux loss included: it sees the same
    real tokens in both), float32; positions restart at 0 in every sequence."""
    seed = fresh_seed()
    (ref_logits, ref_grads), (logits, grads), positions = run_distributed(
        _model_body, world_size=1, args=(seed,), timeout_s=240)[0]
    assert positions.tolist() == [[*range(9), *range(4), 0, *range(6), *range(4)]]
    for b, (got, ref) in enumerate(zip(logits, ref_logits)):
        assert_close_scaled(got, ref, f"seed {seed} sequence {b} logits", **TOLERANCE[torch.float32])
    for name, ref in ref_grads.items():
        assert_close_scaled(grads[name], ref, f"seed {seed} grad {name}", **TOLERANCE[torch.float32])
    assert any(g.abs().max() > 0 for n, g in ref_grads.items() if "router" in n)


def test_packed_sequences_reject_empty_sequences_and_wrong_shapes():
    from moe.model import PackedSequences

    with pytest.raises(ValueError, match="at least one token"):
        PackedSequences.from_lengths([3, 0, 2])
    with pytest.raises(ValueError, match="at least one token"):
        PackedSequences.from_lengths([])


@pytest.mark.gpu
def test_packed_attention_on_cuda_is_varlen_flash_and_equals_padded():
    """On CUDA, bf16 packed attention runs torch's varlen flash attention; fp32 runs SDPA per sequence. Same
    tolerance table as on the CPU; then the whole model."""
    seed = fresh_seed()
    out = run_distributed(_attention_body, world_size=1, args=(seed,), timeout_s=300, env=CUDA_ENV)[0]
    for groups in (HEADS, 2, 1):
        _check_attention(seed, out, groups)
    (ref_logits, ref_grads), (logits, grads), _ = run_distributed(
        _model_body, world_size=1, args=(seed,), timeout_s=300, env=CUDA_ENV)[0]
    for b, (got, ref) in enumerate(zip(logits, ref_logits)):
        assert_close_scaled(got, ref, f"seed {seed} sequence {b} logits", **TOLERANCE[torch.float32])
    for name, ref in ref_grads.items():
        assert_close_scaled(grads[name], ref, f"seed {seed} grad {name}", **TOLERANCE[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa", "mqa"])
def test_varlen_gqa_modes_on_cuda_equal_padded(groups):
    """Each way moe.cuda_calls can hand grouped key/value heads to torch's varlen flash attention on this torch
    ('kwarg' only where it takes enable_gqa; 'grouped' k / v as they are; 'expand' repeated to N heads), in bf16
    against causal SDPA per sequence: the output and the q / k / v gradients within the bf16 rule of the table
    (at most 2x the padded bf16 path's error against float32, plus one bf16 ulp)."""
    from moe import cuda_calls

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    total, scale = sum(LENGTHS), DIM ** -0.5
    q = torch.randn(total, HEADS, DIM, generator=gen).cuda().bfloat16()
    k = torch.randn(total, groups, DIM, generator=gen).cuda().bfloat16()
    v = torch.randn(total, groups, DIM, generator=gen).cuda().bfloat16()
    grad = torch.randn(total, HEADS * DIM, generator=gen).cuda()
    cu_N1 = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")
    reference = _run(lambda a, b, c: _padded_causal(a.float(), b.float(), c.float(), LENGTHS, scale), q, k, v, grad)
    padded = _run(lambda a, b, c: _padded_causal(a, b, c, LENGTHS, scale), q, k, v, grad)
    modes = [m for m in cuda_calls.VARLEN_GQA_MODES
             if m != "kwarg" or cuda_calls.takes_keyword("torch.nn.attention.varlen.varlen_attn", "enable_gqa")]
    for mode in modes:
        got = _run(lambda a, b, c, mode=mode: cuda_calls.varlen_attn(a, b, c, cu_N1, max(LENGTHS), scale=scale,
                                                                     gqa_mode=mode).reshape(total, -1),
                   q, k, v, grad)
        for what, pick in (("output", lambda r: r[0]), ("q", lambda r: r[1][0]), ("k", lambda r: r[1][1]),
                           ("v", lambda r: r[1][2])):
            ref = pick(reference)
            ulp = 2.0**-8 * float(ref.abs().max())
            err = float((pick(got) - ref).abs().max())
            padded_err = float((pick(padded) - ref).abs().max())
            assert err <= 2 * padded_err + ulp, f"seed {seed} {mode} {what}: {err:.3g} vs padded {padded_err:.3g}"
