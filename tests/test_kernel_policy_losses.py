"""The registered GSPO / GSPO-token losses through the fused segmented kernel (megagspo.kernels.policy_losses,
rl.loss_impl=kernels) against the algorithm code (megagspo.algorithm.get_loss): loss, d loss / d logp, and
every metric, on fresh random packed batches with odd shapes (an empty sequence, zero advantages, clipped
sequences on both sides), with and without the KL penalty; and the configurations it refuses.

Legend: B rows (sequences), L positions per row, T = B * L packed tokens.

Tolerance: float32, the kernel and the torch loss sum the same per-token terms in another order: rel 1e-5,
abs 1e-6 on the loss, metrics and gradient (the gradient is a per-sequence constant times the mask: the
kernel's s_i / |y_i| against torch's); float64: 1e-12. The same tolerances hold on CUDA (the `cuda` variant,
marked gpu): there both sides run on the GPU; the kernel's --use_fast_math `exp` is ~2 ulp (~2.4e-7 relative)
off torch's, inside rel 1e-5, and a flipped clip decision needs a sequence ratio within ~3e-7 of a clip bound
(~3e-6 per random sequence here); float64 math is not affected by --use_fast_math.
"""

from __future__ import annotations

import pytest
import torch

import megagspo.kernels as K
from devices import DEVICES
from megagspo.algorithm import PackedBatch, get_loss
from megagspo.kernels.policy_losses import FUSED_LOSSES, fused_loss

TOL = {torch.float32: (1e-6, 1e-5), torch.float64: (1e-12, 1e-12)}


def _batch(B, L, dtype, gen, kl):
    logp = -torch.rand(B, L, generator=gen, dtype=torch.float64).to(dtype) * 3
    # old log-probs: a per-sequence shift of up to +-0.2 plus token noise, so sequence ratios fall on both
    # sides of the clip range [0.95, 1.04]; rows 2 / 3 / 4 are pinned: clipped high, clipped low, live
    shift = (torch.rand(B, 1, generator=gen, dtype=torch.float64) - 0.5) * 0.4
    shift[2:5, 0] = torch.tensor([-0.2, 0.2, 0.0], dtype=torch.float64)
    noise = (torch.rand(B, L, generator=gen, dtype=torch.float64) - 0.5) * 0.02
    old = (logp.double() + shift + noise).to(dtype)
    mask = torch.rand(B, L, generator=gen) < 0.7
    mask[0] = False  # a sequence without response tokens
    mask[2:5, 0] = True
    adv = torch.randn(B, generator=gen, dtype=torch.float64).to(dtype)
    adv[1] = 0.0
    adv[2:5] = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64).to(dtype)
    ref = logp + torch.randn(B, L, generator=gen, dtype=torch.float64).to(dtype) * 0.1 if kl else None
    entropy = torch.rand(B, L, generator=gen, dtype=torch.float64).to(dtype)
    return logp, old, mask, adv, ref, entropy


def _evaluate(fn, name, cfg, logp, old, mask, adv, ref, entropy, num_global):
    x = logp.clone().requires_grad_()
    batch = PackedBatch.from_padded(logp_BL=x, loss_mask_BL=mask, num_global_sequences=num_global,
                                    old_logp_BL=old, advantages_B=adv, ref_logp_BL=ref, entropy_BL=entropy)
    loss, metrics = fn(batch, cfg)
    loss.backward()
    return loss.detach(), x.grad, {k: v.detach() for k, v in metrics.items()}


@pytest.mark.parametrize("name", FUSED_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("B, L, kl", [(7, 13, False), (5, 1, False), (9, 31, True)])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_loss_equals_the_algorithm(name, dtype, B, L, kl, device):
    if device == "cuda" and not K.fused_available("cuda"):
        pytest.skip("megagspo._C built without CUDA kernels")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator().manual_seed(seed)
    # drawn on the CPU (same values for a seed on either device), then moved: both losses run on `device`
    inputs = tuple(None if t is None else t.to(device) for t in _batch(B, L, dtype, gen, kl))
    fields = {"clip_low": 0.05, "clip_high": 0.04}
    if kl:
        fields["kl"] = {"coef": 0.1, "estimator": "k3"}
    torch_loss = get_loss(name)
    cfg = torch_loss.Config(**fields)
    num_global = 2 * B  # this micro-batch is half of the global batch
    ref = _evaluate(torch_loss, name, cfg, *inputs, num_global)
    got = _evaluate(fused_loss(name), name, cfg, *inputs, num_global)
    atol, rtol = TOL[dtype]
    what = f"{name} {dtype} B={B} L={L} kl={kl} on {device} (seed {seed})"
    assert got[0].device.type == device and got[1].device.type == device, what
    torch.testing.assert_close(got[0], ref[0], atol=atol, rtol=rtol, msg=lambda m: f"{what} loss: {m}")
    torch.testing.assert_close(got[1], ref[1], atol=atol, rtol=rtol, msg=lambda m: f"{what} d logp: {m}")
    assert got[2].keys() == ref[2].keys(), what
    for key, value in ref[2].items():
        torch.testing.assert_close(got[2][key].to(value.dtype), value, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what} metric {key}: {m}")
    if L > 1:  # not vacuous: something was clipped and something was not
        assert 0 < float(ref[2]["seq/clip_frac"]) < 1, what
        assert float(ref[1].abs().max()) > 0, what


def test_refused_configurations():
    with pytest.raises(ValueError, match="no fused kernel for loss 'grpo'"):
        fused_loss("grpo")
    gen = torch.Generator().manual_seed(0)
    logp, old, mask, adv, _, _ = _batch(5, 4, torch.float32, gen, False)
    cfg = get_loss("gspo_token").Config()
    per_token = PackedBatch.from_padded(logp_BL=logp, loss_mask_BL=mask, num_global_sequences=5, old_logp_BL=old,
                                        advantages_BL=adv[:, None].expand(5, 4).contiguous())
    with pytest.raises(ValueError, match="needs per-sequence advantages_S"):
        fused_loss("gspo_token")(per_token, cfg)
    corrected = get_loss("gspo").Config(old_policy={"source": "recompute", "correction": {"method": True}})
    batch = PackedBatch.from_padded(logp_BL=logp, loss_mask_BL=mask, num_global_sequences=5, old_logp_BL=old,
                                    advantages_B=adv, rollout_logp_BL=old - 0.1)
    with pytest.raises(ValueError, match="the rollout correction weights sequences"):
        fused_loss("gspo")(batch, corrected)
    bad = logp.clone()
    bad[2, 0] = float("nan")
    mask[2, 0] = True
    nan_batch = PackedBatch.from_padded(logp_BL=bad, loss_mask_BL=mask, num_global_sequences=5, old_logp_BL=old,
                                        advantages_B=adv)
    with pytest.raises(ValueError, match="logp_T"):
        fused_loss("gspo")(nan_batch, get_loss("gspo").Config())


@pytest.mark.parametrize("overrides, match", [
    (["rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.28", "rl.loss_impl=kernels"],
     "rl.loss.impl = 'kernels' has no fused kernel for rl.loss.name = 'grpo'"),
    (["rl.logprob_impl=torch"], "model.logprob_path = 'hidden' .* rl.logprob_impl = 'torch'"),
    (["model.logprob_path=chunks"], "model.logprob_path = 'chunks' is not valid; valid values: hidden, logits"),
    (["model.logprob_chunk_tokens=0"], "model.logprob_chunk_tokens must be a positive integer"),
    (["rl.loss_impl=triton"], "rl.loss.impl = 'triton' is not valid; valid values: torch, kernels"),
])
def test_config_errors_name_the_keys(overrides, match):
    import os

    from megagspo.config import ConfigError, load_config
    from megagspo.trainer.preflight import check_components

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.raises(ConfigError, match=match):  # on load, or (the kernel's reach) in every run's preflight
        check_components(load_config(os.path.join(repo, "configs/tiny_cpu.yaml"), overrides))
    # the logits path with the torch log-probs stays valid
    load_config(os.path.join(repo, "configs/tiny_cpu.yaml"), ["model.logprob_path=logits", "rl.logprob_impl=torch"])
