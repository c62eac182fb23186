"""Torch's fused AdamW on CUDA (moe.optimizer.fused_adamw inside build_optimizer): a scoped, logged, checked patch
of Megatron-Core's Adam picker; the CPU step unchanged.

Every body runs in one spawned process (Megatron's parallel state and DDP): a tiny float32 MoE model in
Megatron's DDP, its fp32 gradient buffers filled with fixed random values, one `optimizer_step` (no clipping),
compared parameter by parameter with `torch.optim.AdamW` stepping a copy of the same weights and gradients
(with the weight decay of the parameter's Megatron parameter group). CPU, unfused: the for-loop AdamW both
sides, bit-equal. Fused: a different kernel (one rounding per operation in another order), within 1e-6 relative.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import tiny_arch
from multiprocess import run_distributed

CUDA_ENV = {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def _step_body(rank, world_size, fused, seed):
    import megatron.core.optimizer as megatron_optimizer

    from moe.model import build_model
    from moe.optimizer import OptimizerSettings, build_optimizer, optimizer_step, wrap_data_parallel, zero_gradients
    from moe.parallel import ParallelLayout, setup_process_groups

    layout = setup_process_groups(ParallelLayout(), seed).layout
    model = build_model(tiny_arch("micro"), layout, use_transformer_engine=False)
    ddp = wrap_data_parallel(model)
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=LR, weight_decay=WEIGHT_DECAY, beta1=BETAS[0],
                                                       beta2=BETAS[1], eps=EPS, clip_grad=0.0), fused=fused)
    restored = megatron_optimizer.torch is torch
    inner = [sub.optimizer for sub in getattr(optimizer, "chained_optimizers", [optimizer])]
    flags = [(type(o).__name__, o.defaults.get("fused"), o.defaults.get("foreach")) for o in inner]

    gen = torch.Generator().manual_seed(seed)
    zero_gradients(ddp, optimizer)
    references = {}
    for name, param in model.named_parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=gen).to(param.main_grad.device))
        copy = param.detach().clone().requires_grad_(True)
        copy.grad = param.main_grad.detach().clone()
        decay = _weight_decay_of(optimizer, param)
        references[name] = (copy, torch.optim.AdamW([copy], lr=LR, betas=BETAS, eps=EPS, weight_decay=decay,
                                                    foreach=False))
    optimizer_step(optimizer)
    pairs = {}
    for name, param in model.named_parameters():
        copy, reference = references[name]
        reference.step()
        pairs[name] = (param.detach().clone(), copy.detach().clone())
    return {"restored": restored, "flags": flags, "pairs": pairs, "device": str(next(model.parameters()).device)}


def _weight_decay_of(optimizer, param) -> float:
    """The weight decay Megatron's parameter groups give `param` (the group its master shard is in)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if param in sub.model_param_group_index_map:
            group_index, _ = sub.model_param_group_index_map[param]
            return sub.optimizer.param_groups[group_index]["weight_decay"]
    raise KeyError("parameter not in the optimizer")


def test_the_patched_megatron_and_torch_symbols_have_the_recorded_shape():
    from moe.optimizer import verify_fused_adamw_target

    verify_fused_adamw_target()


def test_a_changed_adam_picker_fails_loudly(monkeypatch):
    import megatron.core.optimizer as megatron_optimizer

    from moe.optimizer import OptimizerPatchError, fused_adamw, verify_fused_adamw_target

    def _get_megatron_optimizer_based_on_param_groups(config, model_chunks, param_groups):  # an "upgrade"
        return None

    monkeypatch.setattr(megatron_optimizer, "_get_megatron_optimizer_based_on_param_groups",
                        _get_megatron_optimizer_based_on_param_groups)
    with pytest.raises(OptimizerPatchError, match="changed signature"):
        verify_fused_adamw_target()
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", True)
    with pytest.raises(OptimizerPatchError):
        with fused_adamw(True):
            pass
    assert megatron_optimizer.torch is torch
    with fused_adamw(False) as patched:  # disabled: nothing checked, nothing changed
        assert not patched and megatron_optimizer.torch is torch


def test_torch_without_a_fused_argument_fails_loudly():
    from moe.optimizer import OptimizerPatchError, verify_fused_adamw_target

    class _OldAdamW(torch.optim.AdamW):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
            super().__init__(params, lr, betas, eps, weight_decay)

    with pytest.raises(OptimizerPatchError, match="no keyword argument 'fused'"):
        verify_fused_adamw_target(_OldAdamW)
    verify_fused_adamw_target()  # torch's own AdamW has it


def test_inside_the_scope_megatron_builds_fused_adamw_and_outside_nothing_changed():
    import megatron.core.optimizer as megatron_optimizer

    from moe.optimizer import fused_adamw

    params = [torch.nn.Parameter(torch.randn(3))]
    with fused_adamw(True) as patched:
        assert patched == megatron_optimizer.USING_PYTORCH_OPTIMIZER
        built = megatron_optimizer.torch.optim.AdamW(params, lr=1e-3)
        assert megatron_optimizer.torch.optim.Adam is torch.optim.Adam  # every other name is torch's own
        assert megatron_optimizer.torch.zeros is torch.zeros
    assert megatron_optimizer.torch is torch
    assert type(built) is torch.optim.AdamW
    assert built.defaults["fused"] is (True if patched else None)


@pytest.mark.multiprocess
def test_cpu_build_optimizer_steps_exactly_as_torch_adamw_unfused():
    """The CPU path is unchanged: Megatron's default torch AdamW (no fused=, the for-loop kernel), bit-equal."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    out = run_distributed(_step_body, world_size=1, args=(None, seed), timeout_s=180)[0]
    assert out["device"] == "cpu" and out["restored"]
    assert out["flags"] and all(f == ("AdamW", None, None) for f in out["flags"]), out["flags"]
    for name, (got, expected) in out["pairs"].items():
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"seed {seed} {name}: {m}")


@pytest.mark.multiprocess
def test_forced_fused_adamw_patch_steps_like_torch_adamw():
    """The patch mechanism itself, on the CPU (torch's fused CPU kernel): fused=True reaches torch's AdamW
    through Megatron and one step agrees with the for-loop AdamW to rounding."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    out = run_distributed(_step_body, world_size=1, args=(True, seed), timeout_s=180)[0]
    assert out["restored"]
    assert out["flags"] and all(f == ("AdamW", True, None) for f in out["flags"]), out["flags"]
    for name, (got, expected) in out["pairs"].items():
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"seed {seed} {name}: {m}")


@pytest.mark.gpu
def test_cuda_build_optimizer_uses_fused_adamw_and_steps_like_torch_adamw():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    out = run_distributed(_step_body, world_size=1, args=(None, seed), timeout_s=240, env=CUDA_ENV)[0]
    assert out["device"].startswith("cuda") and out["restored"]
    assert out["flags"] and all(f == ("AdamW", True, None) for f in out["flags"]), out["flags"]
    for name, (got, expected) in out["pairs"].items():
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"seed {seed} {name}: {m}")
