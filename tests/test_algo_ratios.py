"""Ratios on packed and padded layouts (eqs. 3, 8), numerical extremes, and input validation."""

from __future__ import annotations


import pytest
import torch

from megagspo.algorithm import (
    GRPOConfig,
    GSPOConfig,
    KLConfig,
    OldPolicyConfig,
    PackedBatch,
    get_loss,
    grpo_loss,
    gspo_sequence_loss,
    gspo_token_loss,
    make_loss_config,
    packed_to_padded,
    padded_to_packed,
    sequence_log_ratio,
    sequence_ratio,
    token_log_ratio,
)
from test_algo_common import F64, assert_close64, cu_from_lengths, gen, leaf, random_packed, ref_gspo_grad, ref_sequence_stats  # noqa: F401


def test_sequence_ratio_is_exp_of_masked_mean_log_ratio(gen):
    b = random_packed(gen, num_seqs=30, max_len=50, seq_shift=0.5)
    s_ref, n_ref = ref_sequence_stats(b["logp"], b["old"], b["mask"], b["cu"])
    m, n = sequence_log_ratio(b["logp"], b["old"], b["mask"], b["cu"])
    assert torch.equal(n, torch.tensor(n_ref, dtype=F64))
    assert_close64(sequence_ratio(b["logp"], b["old"], b["mask"], b["cu"]), torch.tensor(s_ref, dtype=F64))
    assert_close64(torch.exp(m), torch.tensor(s_ref, dtype=F64))
    r = token_log_ratio(b["logp"], b["old"], b["mask"].double())  # 0/1 float masks work too
    assert_close64(r, torch.where(b["mask"], b["logp"] - b["old"], 0.0))


def test_padded_layout_gives_the_packed_result(gen):
    b = random_packed(gen, num_seqs=7, max_len=15)
    lengths = b["cu"].diff()
    L = int(lengths.max()) + 2
    pad = lambda x, v=0.0: packed_to_padded(x, b["cu"], L, pad_value=v)  # noqa: E731
    # Padding is filled with garbage log-probs (-inf/NaN) to show the mask alone decides what counts.
    logp_BL, old_BL = pad(b["logp"], float("-inf")), pad(b["old"], float("nan"))
    mask_BL = pad(b["mask"].double()).bool()
    flat, cu_pad = padded_to_packed(logp_BL)
    assert torch.equal(cu_pad, torch.arange(8) * L) and flat.shape == (7 * L,)
    lp_packed, lp_padded = leaf(b["logp"]), leaf(logp_BL)
    loss_p, _ = gspo_sequence_loss(lp_packed, b["old"], b["mask"], b["cu"], b["adv"], num_global_sequences=7)
    batch = PackedBatch.from_padded(logp_BL=lp_padded, loss_mask_BL=mask_BL, old_logp_BL=old_BL,
                                    advantages_B=b["adv"], num_global_sequences=7)
    loss_d, _ = get_loss("gspo")(batch, GSPOConfig())
    loss_p.backward()
    loss_d.backward()
    assert_close64(loss_d, loss_p)
    assert torch.isfinite(lp_padded.grad).all()
    assert_close64(pad(lp_packed.grad), lp_padded.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extremes_log_ratio_50_and_lengths_1_to_32768_stay_finite(gen, dtype):
    lengths = torch.tensor([1, 2, 3, 777, 32768, 1, 32768, 5])
    cu = cu_from_lengths(lengths)
    T = int(cu[-1])
    seq_id = torch.repeat_interleave(torch.arange(8), lengths)
    # Per-sequence mean log-ratio at the +-50 extremes (and one random-sign +-50 per token sequence).
    level = torch.tensor([50.0, -50.0, 50.0, -50.0, 50.0, -50.0, 0.0, 50.0], dtype=F64)
    log_ratio = level[seq_id] + torch.randn(T, generator=gen, dtype=F64) * 1e-3
    signs = torch.randint(0, 2, (T,), generator=gen).double() * 2 - 1
    log_ratio = torch.where(seq_id == 6, 50.0 * signs, log_ratio)
    old = -torch.rand(T, generator=gen, dtype=F64) * 60
    logp64 = old + log_ratio
    mask = torch.ones(T, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0, 0.5, -0.7, 0.0], dtype=F64)
    N = 8
    grad_ref, _ = ref_gspo_grad(logp64, old, mask, cu, adv, N)
    for name in ("gspo", "gspo_token", "grpo"):
        logp = leaf(logp64.to(dtype))
        adv_arg = adv if name == "gspo" else adv[seq_id]
        fn = {"gspo": gspo_sequence_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}[name]
        loss, metrics = fn(logp, old.to(dtype), mask, cu, adv_arg.to(dtype), num_global_sequences=N)
        loss.backward()
        assert torch.isfinite(loss), name
        assert bool(torch.isfinite(logp.grad).all()), name
        assert all(bool(torch.isfinite(v)) for v in metrics.values()), name
        if name != "grpo":
            # Against the float64 closed form; float32 carries the rounding of logp itself (|logp|~110,
            # ulp 8e-6) through exp(m): relative 1e-3 covers that, float64 is held to 1e-9.
            rtol = 1e-9 if dtype == F64 else 1e-3
            torch.testing.assert_close(logp.grad.double(), grad_ref, rtol=rtol, atol=1e-30)


def test_masked_positions_with_inf_or_nan_never_reach_the_gradient(gen):
    b = random_packed(gen, num_seqs=10, max_len=12)
    logp, old = b["logp"].clone(), b["old"].clone()
    logp[~b["mask"]] = float("-inf")
    old[~b["mask"]] = float("nan")
    for name in ("gspo", "gspo_token", "grpo"):
        lp = leaf(logp)
        batch = PackedBatch(logp_T=lp, loss_mask_T=b["mask"], cu_seqlens_S1=b["cu"], num_global_sequences=10,
                            old_logp_T=old, advantages_S=b["adv"], ref_logp_T=old)
        loss, _ = get_loss(name)(batch, get_loss(name).Config(kl=KLConfig(coef=0.1)))
        loss.backward()
        assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all()), name
        assert bool((lp.grad[~b["mask"]] == 0).all()), name


def test_empty_sequences_contribute_nothing_and_are_counted(gen):
    b = random_packed(gen, num_seqs=5, max_len=8, empty_seq=False)
    # Insert two zero-length sequences (repeated offsets) and fully mask sequence 0.
    cu = torch.cat([b["cu"][:2], b["cu"][1:3], b["cu"][2:]])
    adv = torch.cat([b["adv"][:1], torch.tensor([5.0], dtype=F64), b["adv"][1:2], torch.tensor([-5.0], dtype=F64), b["adv"][2:]])
    mask = b["mask"].clone()
    mask[: int(b["cu"][1])] = False
    lp = leaf(b["logp"])
    loss, m = gspo_sequence_loss(lp, b["old"], mask, cu, adv, num_global_sequences=7)
    loss.backward()
    assert float(m["seq/count"]) == 7 and float(m["seq/empty"]) == 3
    grad_ref, _ = ref_gspo_grad(b["logp"], b["old"], mask, cu, adv, 7)
    assert_close64(lp.grad, grad_ref)
    assert bool((lp.grad[: int(b["cu"][1])] == 0).all())


# ----------------------------------------------------------------------------------------- validation


def _args(b):
    return [b["logp"], b["old"], b["mask"], b["cu"], b["adv"]]


@pytest.mark.parametrize(
    "mutate,pattern",
    [
        (lambda a: a.__setitem__(1, a[1][:-1]), r"old_logp_T has shape .* but logp_T has shape"),
        (lambda a: a.__setitem__(2, a[2][1:]), r"loss_mask_T has shape"),
        (lambda a: a.__setitem__(4, a[4][:-1]), r"cu_seqlens_S1 has length .* sequences"),
        (lambda a: a.__setitem__(3, a[3].flip(0).contiguous()), r"cu_seqlens_S1 must start at 0"),
        (lambda a: a.__setitem__(3, torch.cat([a[3][:2], a[3][3:4], a[3][2:3], a[3][4:]])), r"non-decreasing"),
        (lambda a: a.__setitem__(3, a[3] - torch.nn.functional.pad(torch.ones(1, dtype=torch.int64), (len(a[3]) - 1, 0))),
         r"ends at .* T="),
        (lambda a: a.__setitem__(3, a[3].double()), r"cu_seqlens_S1 must be int32 or int64"),
        (lambda a: a[0].__setitem__(int(torch.nonzero(a[2])[0]), float("nan")), r"logp_T has 1 non-finite"),
        (lambda a: a[1].__setitem__(int(torch.nonzero(a[2])[-1]), float("inf")), r"old_logp_T has 1 non-finite"),
        (lambda a: a[4].__setitem__(0, float("nan")), r"advantages_S has 1 non-finite"),
        (lambda a: a.__setitem__(2, a[2].double() * 0.5), r"loss_mask_T must hold only 0/1"),
        (lambda a: a.__setitem__(0, a[0].reshape(1, -1)), r"logp_T must be 1-D"),
    ],
)
def test_bad_inputs_raise_clear_errors(gen, mutate, pattern):
    b = random_packed(gen, num_seqs=6, max_len=8, empty_seq=False)
    args = [x.clone() for x in _args(b)]
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=pattern):
        gspo_sequence_loss(*args, num_global_sequences=6)


def test_num_global_sequences_must_cover_the_micro_batch(gen):
    b = random_packed(gen, num_seqs=6, max_len=8)
    with pytest.raises(ValueError, match="num_global_sequences=5 is smaller than this micro-batch's 6"):
        gspo_sequence_loss(*_args(b), num_global_sequences=5)
    with pytest.raises(ValueError, match="num_global_tokens"):
        grpo_loss(b["logp"], b["old"], b["mask"], b["cu"], b["adv"][b["seq_id"]], aggregation="token_mean")


def test_registry_and_config_errors_name_the_valid_choices_and_fields():
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'; valid names: grpo, gspo, gspo_token"):
        get_loss("ppo")
    with pytest.raises(ValueError, match=r"GSPOConfig.clip_low must be a finite number >= 0, got -0.001"):
        GSPOConfig(clip_low=-1e-3)
    with pytest.raises(ValueError, match=r"GSPOTokenConfig.clip_high .* got nan"):
        make_loss_config("gspo_token", clip_high=float("nan"))
    with pytest.raises(ValueError, match=r"GRPOConfig.dual_clip must be None or > 1 .*, got 0.9"):
        GRPOConfig(dual_clip=0.9)
    with pytest.raises(ValueError, match=r"GRPOConfig.aggregation must be one of .*token_mean.*, got 'sum'"):
        GRPOConfig(aggregation="sum")
    with pytest.raises(ValueError, match=r"KLConfig.estimator must be one of \['k1', 'k3'\], got 'k2'"):
        GSPOConfig(kl={"estimator": "k2"})
    with pytest.raises(ValueError, match=r"OldPolicyConfig.source must be one of"):
        OldPolicyConfig(source="engine")
    with pytest.raises(ValueError, match=r"RolloutCorrectionConfig.cap must be a finite number >= 1, got 0.5"):
        OldPolicyConfig(correction={"method": True, "cap": 0.5})
    cfg = make_loss_config("grpo", clip_low=0.1, kl={"coef": 0.01})
    assert cfg.clip_low == 0.1 and cfg.kl.coef == 0.01 and cfg.clip_high == 0.27
    assert GSPOConfig().clip_low == 3e-4 and GSPOConfig().clip_high == 4e-4
