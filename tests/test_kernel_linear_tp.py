"""Vocab-parallel chunked linear log-probs (`linear_token_logprobs(..., tp_group=...)`) on 2 gloo ranks against
the 1-rank result and the naive float64 reference; and its argument checks.

Legend: T tokens, H hidden, V vocab (V_r rows on rank r). Each rank holds the rows [lo, hi) of the LM head
weight and the same hidden states; the d hidden of the ranks are summed (as the sequence-parallel gather's
backward does in the trainer), the d weight shards are concatenated. Fresh random inputs every run.

Tolerances against the float64 naive path: float64 1e-11; float32 as a float32 torch run (the GEMMs
dominate): atol 2e-5, rtol 1e-4 (tests/test_kernel_linear.py's table). bf16 logits are rounded by the GEMM
itself, so bf16 answers to the 1-rank bf16 kernel: log-probs and entropies within 2e-6 of it (their
statistics are float32), and d hidden / d weight no less accurate than it, ||shard - f64|| <= LOWP_RATIO
||1-rank - f64|| + LOWP_FLOOR ||f64|| (measured over 6 seeds: ratio <= 1.04 for d hidden, whose shard partials
add in float32 instead of one bf16 product, and 1.00 for d weight).
"""

from __future__ import annotations

import pytest
import torch

import megagspo.kernels as K
from multiprocess import run_distributed

LOWP_RATIO, LOWP_FLOOR = 1.25, 1e-3

pytestmark = pytest.mark.skipif(not K.fused_available("cpu"), reason="megagspo._C not built (make ext)")


def _run(hidden, weight, target, g_lp, g_h, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = K.linear_token_logprobs(h, w, target, with_entropy=True, **kw)
    acc = lp.dtype
    (lp * g_lp.to(acc) + ent * g_h.to(acc)).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


# (T, H, V, split, chunk, dtype, impl): uneven shards, a chunk that does not divide T, T = 1, chunk 1
CASES = [
    (13, 16, 1001, 400, 4, torch.float32, "fused"),
    (7, 8, 515, 1, 3, torch.float64, "fused"),
    (1, 8, 300, 150, 1024, torch.float32, "fused"),
    (9, 16, 4099, 2050, 1, torch.bfloat16, "fused"),
    (6, 8, 257, 100, 4, torch.float64, "auto"),
    (5, 8, 257, 128, 2, torch.float64, "reference"),
]


def _body(rank, world_size, seed):
    out = []
    for i, (T, H, V, split, chunk, dtype, impl) in enumerate(CASES):
        torch.manual_seed(seed + i)  # the same full inputs on both ranks
        hidden = torch.randn(T, H, dtype=torch.float64).to(dtype)
        weight = (torch.randn(V, H, dtype=torch.float64) / H**0.5 * 3).to(dtype)
        target = torch.randint(0, V, (T,))
        g_lp, g_h = torch.randn(T), torch.randn(T)
        lo, hi = [0, split, V][rank], [0, split, V][rank + 1]
        shard = _run(hidden, weight[lo:hi], target, g_lp, g_h, chunk_size=chunk,
                     tp_group=torch.distributed.group.WORLD, vocab_start=lo, impl=impl)
        d_hidden = shard[2].double()
        torch.distributed.all_reduce(d_hidden)  # the shards' partial d hidden, summed as the SP gather's backward
        whole = _run(hidden, weight, target, g_lp, g_h, chunk_size=chunk, impl="fused")
        naive = _run(hidden.double(), weight.double(), target, g_lp, g_h, impl="reference")
        out.append((shard[0], shard[1], d_hidden, shard[3], whole, naive, (lo, hi)))
    return out


@pytest.mark.multiprocess
def test_vocab_parallel_linear_matches_one_rank_and_the_naive_reference():
    seed = int(torch.randint(0, 2**20, ()).item())
    per_rank = run_distributed(_body, world_size=2, args=(seed,), timeout_s=240)
    for i, (T, H, V, split, chunk, dtype, impl) in enumerate(CASES):
        case = f"T={T} H={H} V={V} split={split} chunk={chunk} {dtype} impl={impl} (seed {seed + i})"
        d_weight = torch.cat([per_rank[r][i][3] for r in range(2)])
        for rank in range(2):
            lp, ent, d_hidden, _, whole, naive, _ = per_rank[rank][i]
            got = (lp, ent, d_hidden, d_weight)
            if dtype == torch.bfloat16:
                for name, a, b in zip(("logp", "entropy"), got[:2], whole[:2]):
                    torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6, msg=lambda m: f"rank {rank} {name}: {case}: {m}")
                for name, a, b, n in zip(("d hidden", "d weight"), got[2:], whole[2:], naive[2:]):
                    err, err_1 = (a.double() - n).norm(), (b.double() - n).norm()
                    assert err <= LOWP_RATIO * err_1 + LOWP_FLOOR * n.norm(), \
                        f"rank {rank} {name}: {case}: error {err:.3e} vs one-rank bf16 {err_1:.3e}"
                continue
            atol, rtol = (1e-11, 1e-10) if dtype == torch.float64 else (2e-5, 1e-4)
            for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, naive):
                torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol,
                                           msg=lambda m: f"rank {rank} {name}: {case}: {m}")
        assert torch.equal(per_rank[0][i][0], per_rank[1][i][0]), f"ranks disagree on logp: {case}"


def test_argument_errors():
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_start=2 needs a tp_group"):
        K.linear_token_logprobs(h, w, t, vocab_start=2)
    with pytest.raises(ValueError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        K.linear_token_logprobs(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        K.linear_token_logprobs(h, w, t, chunk_size=2.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_grad_buffer_receives_d_weight(dtype, monkeypatch):
    """d weight added into a float32 buffer (as into Megatron DDP's main_grad) equals the returned gradient of
    the plain call, on top of what the buffer held; autograd gets zeros, and a second use of the weight (a tied
    embedding) still gets its own gradient through autograd. bf16: the V-blocked products (blocks of 7 rows
    here) are the plain call's, summed in float32; the plain call then rounds the sum to bf16."""
    monkeypatch.setattr(K, "_WEIGHT_GRAD_BLOCK_ELEMENTS", 7 * 16)
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    T, H, V = 11, 16, 101
    hidden = torch.randn(T, H).to(dtype)
    weight = (torch.randn(V, H) / 4).to(dtype)
    target = torch.randint(0, V, (T,))
    g_lp, g_h = torch.randn(T), torch.randn(T)
    plain = _run(hidden, weight, target, g_lp, g_h, chunk_size=4, impl="fused")

    held = torch.randn(V, H)
    buffer = held.clone()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = K.linear_token_logprobs(h, w, target, chunk_size=4, with_entropy=True, weight_grad_buffer=buffer,
                                      impl="fused")
    lookup = w[target].float().sum()  # the weight's other use, e.g. the tied embedding
    ((lp * g_lp + ent * g_h).sum() + lookup).backward()
    torch.testing.assert_close(lp.detach(), plain[0], atol=0, rtol=0)
    torch.testing.assert_close(h.grad, plain[2], atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(buffer - held, plain[3], atol=1e-6, rtol=1e-6, msg=lambda m: f"seed {seed}: {m}")
    else:  # the plain call rounds its float32 accumulator to bf16 at the end, the buffer keeps float32: one
        # bf16 rounding (2^-8 relative) apart
        torch.testing.assert_close(buffer - held, plain[3].float(), atol=1e-6, rtol=2.0**-8,
                                   msg=lambda m: f"seed {seed}: {m}")
    expected_lookup = torch.zeros(V, H).index_add_(0, target, torch.ones(T, H)).to(dtype)
    torch.testing.assert_close(w.grad, expected_lookup, atol=0, rtol=0)  # autograd saw zeros from the kernel
    with pytest.raises(ValueError, match="weight_grad_buffer must be a float32"):
        K.linear_token_logprobs(hidden, weight, target, weight_grad_buffer=torch.zeros(V, H + 1))
