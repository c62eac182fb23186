"""GSPO / GSPO-token / GRPO losses: closed-form gradients (eqs. 11, 13, 18), the GSPO-token == GSPO
identity, on-policy behaviour, KL, and that the loss path never needs the host (runs on meta tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from megagspo.algorithm import (
    GSPOConfig,
    KLConfig,
    PackedBatch,
    get_loss,
    grpo_loss,
    gspo_sequence_loss,
    gspo_token_loss,
    token_kl,
)
from test_algo_common import (F64, assert_close64, every_input_batch, gen, leaf, random_packed,  # noqa: F401
                              ref_gspo_grad, ref_gspo_loss)


def _gspo(b, logp, N, **kw):
    return gspo_sequence_loss(logp, b["old"], b["mask"], b["cu"], b["adv"], num_global_sequences=N, **kw)


def test_gspo_loss_and_gradient_match_eq6_and_eq11(gen):
    b = random_packed(gen, num_seqs=64, max_len=40)
    N = 64 + int(torch.randint(0, 50, (1,), generator=gen))  # part of a larger global batch
    logp = leaf(b["logp"])
    loss, metrics = _gspo(b, logp, N)
    loss.backward()
    grad_ref, clipped = ref_gspo_grad(b["logp"], b["old"], b["mask"], b["cu"], b["adv"], N)
    assert 0 < sum(clipped) < len(clipped) - 1, "the draw should clip some sequences and keep others"
    assert_close64(loss, torch.tensor(ref_gspo_loss(b["logp"], b["old"], b["mask"], b["cu"], b["adv"], N), dtype=F64))
    assert_close64(logp.grad, grad_ref)
    nonempty = metrics["seq/nonempty"]
    assert metrics["seq/empty"] == 1 and metrics["seq/count"] == 64
    assert math.isclose(float(metrics["seq/clip_frac"] * nonempty), sum(clipped), abs_tol=1e-9)


def test_gspo_clip_ranges_are_separate_and_one_sided(gen):
    # Single-token sequences with exact ratios: which side clips depends on the sign of A.
    ratios = torch.tensor([1.0 + 5e-4, 1.0 + 3.5e-4, 1.0 - 3.5e-4, 1.0 - 2.5e-4, 1.0 + 5e-4, 1.0 - 5e-4], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0], dtype=F64) * (1 + torch.rand(6, generator=gen, dtype=F64))
    old = -torch.rand(6, generator=gen, dtype=F64)
    logp = leaf(old + torch.log(ratios))
    cu = torch.arange(7)
    loss, m = gspo_sequence_loss(logp, old, torch.ones(6, dtype=torch.bool), cu, adv, num_global_sequences=6)
    loss.backward()
    # clipped: #0 (A>0, s>1+4e-4) and #2 (A<0, s<1-3e-4); #4, #5 stay live on the unbounded side.
    live = torch.tensor([0, 1, 0, 1, 1, 1], dtype=F64)
    assert_close64(logp.grad, -adv * ratios * live / 6)
    assert float(m["seq/clip_high_frac"]) == pytest.approx(1 / 6, abs=1e-12)
    assert float(m["seq/clip_low_frac"]) == pytest.approx(1 / 6, abs=1e-12)
    expected = -(adv * torch.tensor([1 + 4e-4, 1 + 3.5e-4, 1 - 3e-4, 1 - 2.5e-4, 1 + 5e-4, 1 - 5e-4], dtype=F64)).sum() / 6
    assert_close64(loss, expected)


def _grpo_ref_grad(b, adv_T, N, clip_low, clip_high):
    """Eq. 13 with the token clip indicator: -(1/N) A_t w_t / |y_i| on unclipped response tokens."""
    grad = torch.zeros_like(b["logp"])
    for i in range(len(b["cu"]) - 1):
        a, z = int(b["cu"][i]), int(b["cu"][i + 1])
        n = int(b["mask"][a:z].sum())
        for t in range(a, z):
            if not b["mask"][t]:
                continue
            w = math.exp(float(b["logp"][t] - b["old"][t]))
            A = float(adv_T[t])
            if (A > 0 and w > 1 + clip_high) or (A < 0 and w < 1 - clip_low):
                continue
            grad[t] = -A * w / n / N
    return grad


def test_grpo_gradient_matches_eq13(gen):
    b = random_packed(gen, num_seqs=24, max_len=30, seq_shift=0.1, token_noise=0.3)
    adv_T = b["adv"][b["seq_id"]]
    N = 30
    logp = leaf(b["logp"])
    loss, m = grpo_loss(logp, b["old"], b["mask"], b["cu"], adv_T, num_global_sequences=N)
    loss.backward()
    assert 0 < float(m["tok/clip_low_frac"]) and 0 < float(m["tok/clip_high_frac"])
    assert_close64(logp.grad, _grpo_ref_grad(b, adv_T, N, 0.2, 0.27))


def test_grpo_token_mean_and_dual_clip(gen):
    b = random_packed(gen, num_seqs=24, max_len=30, seq_shift=0.5, token_noise=1.0)
    adv_T = torch.randn(len(b["logp"]), generator=gen, dtype=F64)
    n_tok = int(b["mask"].sum()) + 7
    logp = leaf(b["logp"])
    loss, _ = grpo_loss(logp, b["old"], b["mask"], b["cu"], adv_T, aggregation="token_mean",
                        dual_clip=3.0, num_global_tokens=n_tok)
    loss.backward()
    w = torch.exp(b["logp"] - b["old"])
    obj = torch.minimum(w * adv_T, w.clamp(0.8, 1.27) * adv_T)
    obj = torch.where(adv_T < 0, torch.maximum(obj, 3.0 * adv_T), obj)
    live = (w * adv_T == obj) & b["mask"]
    assert bool(((adv_T < 0) & (w > 3.0) & b["mask"]).any()), "the draw should exercise the dual clip"
    assert_close64(loss, -(obj * b["mask"]).sum() / n_tok)
    assert_close64(logp.grad, torch.where(live, -adv_T * w / n_tok, torch.zeros_like(w)))


def test_gspo_token_equals_gspo_when_token_advantages_are_uniform(gen):
    b = random_packed(gen, num_seqs=48, max_len=32)
    N = 48
    lp1, lp2 = leaf(b["logp"]), leaf(b["logp"])
    loss1, m1 = _gspo(b, lp1, N)
    loss2, m2 = gspo_token_loss(lp2, b["old"], b["mask"], b["cu"], b["adv"][b["seq_id"]], num_global_sequences=N)
    loss1.backward()
    loss2.backward()
    assert_close64(loss2, loss1)
    assert_close64(lp2.grad, lp1.grad)
    # Clip decisions: same clipped sequences, same clipped tokens, on the same sides.
    assert float(m1["seq/clip_frac"]) > 0
    for key in ("seq/clip_frac", "seq/clip_low_frac", "seq/clip_high_frac", "tok/clip_frac",
                "tok/clip_low_frac", "tok/clip_high_frac", "ratio/mean", "ratio/min", "ratio/max"):
        assert_close64(m2[key], m1[key], msg=key)
    assert torch.equal(lp1.grad == 0, lp2.grad == 0)


def test_gspo_token_gradient_matches_eq18_with_token_advantages(gen):
    b = random_packed(gen, num_seqs=20, max_len=20)
    adv_T = torch.randn(len(b["logp"]), generator=gen, dtype=F64)
    N = 25
    logp = leaf(b["logp"])
    loss, _ = gspo_token_loss(logp, b["old"], b["mask"], b["cu"], adv_T, num_global_sequences=N)
    loss.backward()
    expected = torch.zeros_like(b["logp"])
    for i in range(len(b["cu"]) - 1):
        a, z = int(b["cu"][i]), int(b["cu"][i + 1])
        sel = b["mask"][a:z]
        n = int(sel.sum())
        if n == 0:
            continue
        s = math.exp(float((b["logp"][a:z] - b["old"][a:z])[sel].mean()))
        for t in range(a, z):
            A = float(adv_T[t])
            if sel[t - a] and not ((A > 0 and s > 1 + 4e-4) or (A < 0 and s < 1 - 3e-4)):
                expected[t] = -s * A / n / N
    assert_close64(logp.grad, expected)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_on_policy_ratios_are_one_and_gradient_is_length_normalised_pg(gen, name):
    b = random_packed(gen, num_seqs=32, max_len=28)
    N = 32
    logp = leaf(b["logp"])
    batch = PackedBatch(logp_T=logp, loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=N,
                        old_logp_T=b["logp"].clone(), advantages_S=b["adv"])
    loss, m = get_loss(name)(batch, get_loss(name).Config())
    loss.backward()
    assert float(m["ratio/mean"]) == 1.0 and float(m["ratio/min"]) == 1.0 and float(m["ratio/max"]) == 1.0
    assert float(m["seq/clip_frac"]) == 0.0 and float(m["tok/clip_frac"]) == 0.0
    assert float(m["kl/approx_old"]) == 0.0
    lengths = torch.zeros(32, dtype=F64).index_add(0, b["seq_id"], b["mask"].double())
    expected = torch.where(b["mask"], -b["adv"][b["seq_id"]] / (N * lengths.clamp(min=1)[b["seq_id"]]), 0.0)
    assert_close64(logp.grad, expected)
    nonempty = lengths > 0
    assert_close64(loss, -b["adv"][nonempty].sum() / N)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_value_and_gradient(gen, estimator):
    b = random_packed(gen, num_seqs=12, max_len=16)
    ref = b["logp"] + 0.3 * torch.randn(len(b["logp"]), generator=gen, dtype=F64)
    N, coef = 12, 0.05
    cfg = GSPOConfig(kl=KLConfig(coef=coef, estimator=estimator))
    lp_kl, lp0 = leaf(b["logp"]), leaf(b["logp"])
    mk = dict(loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=N, old_logp_T=b["old"],
              advantages_S=b["adv"], ref_logp_T=ref)
    loss_kl, m = get_loss("gspo")(PackedBatch(logp_T=lp_kl, **mk), cfg)
    loss0, _ = get_loss("gspo")(PackedBatch(logp_T=lp0, **mk), GSPOConfig())
    loss_kl.backward()
    loss0.backward()
    d = ref - b["logp"]
    kl_T = -d if estimator == "k1" else torch.exp(d) - d - 1
    dkl_T = torch.ones_like(d) if estimator == "k1" else 1 - torch.exp(d)
    lengths = torch.zeros(12, dtype=F64).index_add(0, b["seq_id"], b["mask"].double()).clamp(min=1)[b["seq_id"]]
    per_tok = torch.where(b["mask"], kl_T / lengths, 0.0)
    assert_close64(loss_kl - loss0, coef * per_tok.sum() / N)
    assert_close64(m["loss/kl"], coef * per_tok.sum() / N)
    assert_close64(lp_kl.grad - lp0.grad, torch.where(b["mask"], coef * dkl_T / lengths / N, 0.0))
    if estimator == "k3":
        assert bool((token_kl(b["logp"], ref, b["mask"], "k3") >= 0).all())


def test_kl_is_off_by_default_and_needs_ref_when_on(gen):
    assert GSPOConfig().kl.coef == 0.0 and not GSPOConfig().kl.enabled
    b = random_packed(gen, num_seqs=4, max_len=6)
    batch = PackedBatch(logp_T=b["logp"], loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=4,
                        old_logp_T=b["old"], advantages_S=b["adv"])
    with pytest.raises(ValueError, match="ref_logp_T"):
        get_loss("gspo")(batch, GSPOConfig(kl={"coef": 0.1}))


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_loss_path_needs_no_host_sync(gen, name):
    # On the meta device any .item(), bool(tensor) or data-dependent size raises, so a forward and
    # backward that complete here cannot sync the device. (validate=True is the documented exception.)
    b = random_packed(gen, num_seqs=8, max_len=10)
    meta = {k: v.to("meta") for k, v in b.items()}
    logp = torch.empty_like(meta["logp"]).requires_grad_(True)
    batch, cfg = every_input_batch(name, meta, logp, num_global_sequences=8, num_global_tokens=50)
    loss, metrics = get_loss(name)(batch, cfg)
    loss.backward()
    assert loss.device.type == "meta" and logp.grad.shape == logp.shape
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())
    assert {"entropy/mean", "rollout_is/mean", "kl/ref", "tok/clip_high_frac", "ratio/max"} <= set(metrics)


def test_entropy_metric_is_the_response_token_mean(gen):
    b = random_packed(gen, num_seqs=6, max_len=9)
    ent = torch.rand(len(b["logp"]), generator=gen, dtype=F64)
    _, m = gspo_sequence_loss(b["logp"], b["old"], b["mask"], b["cu"], b["adv"], num_global_sequences=6, entropy_T=ent)
    assert_close64(m["entropy/mean"], ent[b["mask"]].mean())


def test_bf16_inputs_compute_in_float32(gen):
    b = random_packed(gen, num_seqs=8, max_len=16)
    logp = leaf(b["logp"].bfloat16())
    loss, m = gspo_sequence_loss(logp, b["old"].bfloat16(), b["mask"], b["cu"], b["adv"], num_global_sequences=8)
    loss.backward()
    assert loss.dtype == torch.float32 and logp.grad.dtype == torch.bfloat16
    assert torch.isfinite(loss) and bool(torch.isfinite(logp.grad).all())
