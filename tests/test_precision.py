"""bf16 parameters against fp32 through the production path (Megatron DDP + distributed optimizer), on the CPU
(CI) and, marked `gpu`, on CUDA:

- the bf16 policy really is mixed precision: bf16 weight matrices (the norm weights stay float32: Megatron's
  torch-norm fallback builds them so, as TE would not), fp32 gradient buffers (`main_grad`), fp32 master
  weights and Adam moments inside Megatron's distributed optimizer;
- from the same weights, the bf16 model's token log-probs equal the fp32 model's within the bf16 tolerance
  below, and cold-start SFT's losses follow the fp32 run's step by step (same data, same seed);
- a bf16 resume continues bit for bit from the checkpoint's fp32 masters, moments and step;
- the fp32 master weights carry updates smaller than bf16's resolution (an update of 1e-4 relative moves a
  master weight but not its bf16 copy), so that many small steps add up as they do in fp32.

Tolerances, from measurements on CPU over 6 seeds (671532, 1017789, 751333, 479118, 564954, 913679): max
|logp_bf16 - logp_fp32| 0.004-0.019 nats and mean 0.0012-0.0017 nats (log-probs around -3); SFT losses within
0.21% relative at every step. bf16 keeps 8 mantissa bits, so each matmul rounds its inputs to ~0.4% relative.
Asserted: log-probs max 0.08 nats (4x the largest measured) and mean 0.006 (3.5x), SFT losses 1% relative
(5x), and a nonzero difference (a model computing in fp32 by mistake would fail the dtype checks first).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import fresh_seed, tiny_arch, tiny_trainer
from multiprocess import run_distributed

BASE = ["threads=1", "data.train_size=200", "data.eval_size=8", "rl.eval_samples=0", "sft.batch_size=16",
        "model.initializer_range=0.02",  # the init the tolerances below were measured at (the recipe may differ)
        "sft.steps=6", "sft.warmup_steps=0", "sft.lr=0.003", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", "log.save_checkpoint=false"]
LOGP_MAX_ABS, LOGP_MEAN_ABS, SFT_LOSS_REL = 0.08, 0.006, 0.01


def _trainer(overrides):
    return tiny_trainer(overrides)


def _batch(trainer, rows: int, seed: int):
    """A fixed batch of prompt + demonstration-answer rows, on the model's device."""
    from megagspo.policy.megatron_policy import build_sequences

    tok = trainer.tokenizer
    gen = torch.Generator().manual_seed(seed)
    examples = [trainer.train_ds.examples[int(i)] for i in torch.randint(0, len(trainer.train_ds), (rows,),
                                                                          generator=gen)]
    answers = [tok.encode(ex.answer) + [tok.eos_id] for ex in examples]
    width = max(map(len, answers))
    resp = torch.full((rows, width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    for i, a in enumerate(answers):
        resp[i, :len(a)] = torch.tensor(a)
        mask[i, :len(a)] = True
    inp, tgt, lmask, _ = build_sequences([list(ex.prompt_ids) for ex in examples], resp, mask, tok.pad_id)
    dev = trainer.policy.device
    return inp.to(dev), tgt.to(dev), lmask.to(dev)


def _sft_losses(trainer) -> list:
    trainer.run_sft()
    return [row["sft/loss"] for row in trainer.logger.rows if row.get("phase") == "sft"]


def _compare_body(rank, world_size, out_dir, seed):
    from safetensors.torch import save_file

    common = [*BASE, f"seed={seed}", f"log.out_dir={out_dir}"]
    fp32 = _trainer([*common, "name=fp32", "model.precision=fp32"])
    init = os.path.join(out_dir, "init.safetensors")
    save_file({k: v.contiguous() for k, v in fp32.policy.full_state_dict().items()}, init)
    inp, tgt, lmask = _batch(fp32, rows=16, seed=seed)
    with torch.no_grad():
        logp32, _ = fp32.policy.token_logprobs(inp, tgt)
    losses32 = _sft_losses(fp32)

    bf16 = _trainer([*common, "name=bf16", "model.precision=bf16", f"model.init_from={init}"])
    policy = bf16.policy
    dtypes = {str(p.dtype) for n, p in policy.model.named_parameters() if not n.endswith("layernorm.weight")}
    grad_dtypes = {str(p.main_grad.dtype) for p in policy.model.parameters()}
    with torch.no_grad():
        logp16, _ = policy.token_logprobs(inp, tgt)
    # fp32 master weights: a tiny update moves the master copy, not yet its bf16 parameter
    optimizer = bf16.make_rl_optimizer()
    subs = optimizer.chained_optimizers
    masters = [t for sub in subs for group in sub.shard_fp32_from_float16_groups for t in group]
    master_dtypes = {str(t.dtype) for t in masters}
    moments = {str(v.dtype) for sub in subs for st in sub.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0}
    del optimizer
    losses16 = _sft_losses(bf16)
    mask = lmask.bool()
    return dict(dtypes=dtypes, grad_dtypes=grad_dtypes, master_dtypes=master_dtypes, moments=moments,
                logp32=logp32[mask].float(), logp16=logp16[mask].float(), losses32=losses32, losses16=losses16,
                device=str(policy.device))


def _check(result, seed, device_type):
    where = f"seed {seed}"
    assert result["device"].startswith(device_type), result["device"]
    assert result["dtypes"] == {"torch.bfloat16"}, f"{where}: bf16 policy weight matrices {result['dtypes']}"
    assert result["grad_dtypes"] == {"torch.float32"}, f"{where}: DDP gradient buffers {result['grad_dtypes']}"
    assert result["master_dtypes"] == {"torch.float32"}, f"{where}: master weights {result['master_dtypes']}"
    diff = (result["logp16"] - result["logp32"]).abs()
    assert diff.numel() > 0 and float(result["logp32"].abs().mean()) > 0.1  # real log-probs, not a constant
    print(f"{where}: log-prob |bf16 - fp32| max {float(diff.max()):.4f} mean {float(diff.mean()):.4f}")
    assert float(diff.max()) <= LOGP_MAX_ABS, f"{where}: log-prob max diff {float(diff.max())}"
    assert float(diff.mean()) <= LOGP_MEAN_ABS, f"{where}: log-prob mean diff {float(diff.mean())}"
    assert float(diff.max()) > 0, f"{where}: bf16 log-probs equal fp32 exactly: not computed in bf16"
    l32, l16 = result["losses32"], result["losses16"]
    assert len(l32) == len(l16) >= 2
    print(f"{where}: SFT loss |bf16 - fp32| / fp32 max {max(abs(a - b) / abs(a) for a, b in zip(l32, l16)):.4f}")
    for step, (a, b) in enumerate(zip(l32, l16)):
        assert abs(a - b) <= SFT_LOSS_REL * abs(a), f"{where}: SFT loss step {step}: bf16 {b} vs fp32 {a}"
    assert l16[-1] < l16[0], f"{where}: bf16 SFT did not lower the loss: {l16}"


@pytest.mark.multiprocess
def test_bf16_policy_is_mixed_precision_and_tracks_fp32_on_cpu(tmp_path):
    seed = fresh_seed()
    result = run_distributed(_compare_body, world_size=1, args=(str(tmp_path), seed), timeout_s=240)[0]
    _check(result, seed, "cpu")


@pytest.mark.gpu
def test_bf16_policy_is_mixed_precision_and_tracks_fp32_on_cuda(tmp_path):
    seed = fresh_seed()
    env = {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    result = run_distributed(_compare_body, world_size=1, args=(str(tmp_path), seed), timeout_s=300, env=env)[0]
    _check(result, seed, "cuda")


def _tiny_bf16_model(seed: int):
    """A one-layer bf16 MoE model in Megatron's DDP, in this (1-rank) process. -> (model, ddp)."""
    from moe.model import build_model
    from moe.optimizer import wrap_data_parallel
    from moe.parallel import ParallelLayout, setup_process_groups

    layout = setup_process_groups(ParallelLayout(), seed).layout
    model = build_model(tiny_arch("micro"), layout, params_dtype=torch.bfloat16)
    return model, wrap_data_parallel(model)


def _master_weights_body(rank, world_size, seed):
    """One bf16 parameter, an update far below bf16's resolution, 64 times: the fp32 master weight moves by
    the sum, the bf16 copy only when the sum crosses a bf16 step (what plain bf16 weights would lose)."""
    from moe.optimizer import OptimizerSettings, build_optimizer, optimizer_step, zero_gradients

    model, ddp = _tiny_bf16_model(seed)
    with torch.no_grad():  # before the optimizer copies its fp32 masters from the weights
        dict(model.named_parameters())["decoder.layers.0.self_attention.linear_proj.weight"].fill_(1.0)
    # Adam's first steps are sign-like: lr is the per-step change of every weight with a gradient
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=1e-4, clip_grad=0.0))
    norm = dict(model.named_parameters())["decoder.layers.0.self_attention.linear_proj.weight"]
    assert norm.dtype == torch.bfloat16
    start = norm.detach().float().clone()
    for _ in range(64):
        zero_gradients(ddp)
        norm.main_grad.fill_(1.0)
        optimizer_step(optimizer)
    masters = {id(model_param): master for sub in optimizer.chained_optimizers
               for model_group, master_group in zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups)
               for model_param, master in zip(model_group, master_group)}
    return start, norm.detach().float().clone(), masters[id(norm)].detach().clone().view(norm.shape)  # DP=1: whole


@pytest.mark.multiprocess
def test_fp32_master_weights_accumulate_updates_below_bf16_resolution():
    start, bf16_now, master = run_distributed(_master_weights_body, world_size=1, args=(7,), timeout_s=120)[0]
    assert torch.all(start == 1.0)
    # 64 Adam steps of lr 1e-4 against a constant gradient: each weight moved by ~64e-4 in fp32
    torch.testing.assert_close(master, torch.full_like(master, 1.0 - 64e-4), rtol=0, atol=2e-4)
    # bf16's spacing just below 1.0 is 2^-8 = 0.0039: one step of 1e-4 rounds back to 1.0 (pure bf16 weights
    # would never move), yet the bf16 copy follows the master (it is the master rounded): it moved too
    assert torch.tensor(1.0 - 1e-4).to(torch.bfloat16).item() == 1.0
    torch.testing.assert_close(bf16_now, master.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert float(bf16_now.max()) < 1.0


def _bf16_resume_body(rank, world_size, directory, seed):
    """bf16 weights, 3 distributed-optimizer steps, a checkpoint of model + optimizer, 3 more steps; then the
    weights put back, a FRESH optimizer loaded from the checkpoint, the same 3 steps. -> (weights after the
    uninterrupted steps, after the resumed ones, after 3 steps of a fresh optimizer that did not load)."""
    from moe import dist_checkpoint
    from moe.optimizer import OptimizerSettings, build_optimizer, optimizer_step, zero_gradients

    model, ddp = _tiny_bf16_model(seed)
    settings = OptimizerSettings(lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()} for _ in range(6)]

    def steps(optimizer, chunk):
        for g in chunk:
            zero_gradients(ddp)
            for n, p in model.named_parameters():
                p.main_grad.copy_(g[n])
            optimizer_step(optimizer)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    optimizer = build_optimizer(ddp, settings)
    steps(optimizer, grads[:3])
    dist_checkpoint.save_model(model, os.path.join(directory, "model"))
    dist_checkpoint.save_optimizer(model, optimizer, os.path.join(directory, "optimizer"))
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    uninterrupted = steps(optimizer, grads[3:])

    def restart(load: bool):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        fresh = build_optimizer(ddp, settings)  # its fp32 masters start from the bf16 weights
        if load:
            dist_checkpoint.load_model(model, os.path.join(directory, "model"))
            dist_checkpoint.load_optimizer(model, fresh, os.path.join(directory, "optimizer"))
        return steps(fresh, grads[3:])

    return uninterrupted, restart(load=True), restart(load=False)


@pytest.mark.multiprocess
def test_bf16_resume_continues_exactly_from_the_fp32_master_weights(tmp_path):
    """A bf16 run resumed from a checkpoint updates from the saved fp32 masters (and moments, step), so its next
    steps equal the uninterrupted run's bit for bit; an optimizer that restarts from the rounded bf16 weights
    (and fresh moments) does not."""
    seed = fresh_seed()
    uninterrupted, resumed, restarted = run_distributed(_bf16_resume_body, world_size=1,
                                                        args=(str(tmp_path), seed), timeout_s=120)[0]
    assert all(t.dtype == torch.bfloat16 for n, t in uninterrupted.items() if not n.endswith("layernorm.weight"))
    for name, weight in uninterrupted.items():
        assert torch.equal(resumed[name], weight), f"seed {seed}: {name} differs after the resume"
    assert any(not torch.equal(restarted[n], w) for n, w in uninterrupted.items())
