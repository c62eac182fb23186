"""Megatron-Core 0.16.1 on CPU: a tiny Qwen3-like MoE GPTModel trains forward/backward in 1 process and
in 2 gloo processes at TP=2, EP=2 and TP=2+EP=2, with both token dispatchers; the loss and every gradient
equal the 1-process run on the same weights and the same global batch.

Tolerance: float32 throughout; layouts change only the order of float32 reductions (split GEMMs,
all-reduces), so results agree to a few float32 ulps of the largest value: atol 2e-6 * max|ref| + 1e-7,
rtol 1e-5 on the loss and each gradient. Router aux loss is on (coef 0.01) so its gradient path is
covered too... except where noted in `_ARCH`.
"""

from __future__ import annotations

import pytest
import torch

from devices import megatron_groups
from helpers import scaled_close, tiny_arch
from multiprocess import run_distributed

# Layer 0 dense (SwiGLU MLP, TP-split gate/up), layers 1-2 MoE: the mixed models Qwen3 allows.
_ARCH = tiny_arch("mixed", num_hidden_layers=3, router_aux_loss_coef=0.0)
_BATCH, _SEQ = 4, 12
RTOL, ATOL_SCALE = 1e-5, 2e-6
_assert_close = scaled_close(rtol=RTOL, atol_scale=ATOL_SCALE)


def _loss_and_grads(model, tokens_BS, num_global_tokens, dp_group_reduce):
    """Sum of next-token cross entropy over this rank's rows / global token count, and local grads."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from moe.model import forward_logits
    from moe.optimizer import finish_gradients, gather_reduced_gradients, loss_scale_for_sum, wrap_data_parallel

    # the parallel runs go through Megatron's DDP (fp32 gradient buffers, finalize_model_grads), as training does
    ddp = wrap_data_parallel(model) if dp_group_reduce else None
    logits_BSV = forward_logits(model, tokens_BS[:, :-1])
    # vocab_parallel_cross_entropy takes [S, B, V/TP] and combines max / sum-exp across the TP group.
    per_token = vocab_parallel_cross_entropy(logits_BSV.transpose(0, 1).contiguous(), tokens_BS[:, 1:].t().contiguous())
    loss = per_token.sum() / num_global_tokens
    if ddp is None:
        model.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # Sum over replicas: the loss is already normalised by the global token count (DDP's 1 / DP undone)
    (loss * loss_scale_for_sum(ddp)).backward()
    finish_gradients(ddp)
    gather_reduced_gradients(ddp)  # the distributed optimizer's layout leaves each rank its shard only
    loss = loss.detach()
    dp_group = ps.get_data_parallel_group()
    if torch.distributed.get_world_size(dp_group) > 1:
        torch.distributed.all_reduce(loss, group=dp_group)
    return loss, {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def _parity_body(rank, world_size, layout_kwargs, dispatcher, seed):
    from megatron.core import parallel_state as ps

    from moe.model import build_model
    from moe.parallel import destroy_model_parallel
    from moe.sharding import local_view_of_full, load_full_state_dict

    arch = _ARCH
    generator = torch.Generator().manual_seed(seed)
    tokens_BS = torch.randint(0, arch.vocab_size, (_BATCH, _SEQ + 1), generator=generator)
    num_global_tokens = _BATCH * _SEQ

    # Reference: the whole model, the whole batch, no parallelism (every rank computes it alone).
    megatron_groups(seed)
    reference = build_model(arch, token_dispatcher=dispatcher)
    full_weights = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_loss, ref_grads = _loss_and_grads(reference, tokens_BS, num_global_tokens, dp_group_reduce=False)
    del reference
    destroy_model_parallel()

    layout = megatron_groups(seed, **layout_kwargs)
    model = build_model(arch, layout, token_dispatcher=dispatcher)
    load_full_state_dict(model, full_weights)
    dp_size = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    rows = _BATCH // dp_size
    local_tokens = tokens_BS[dp_rank * rows:(dp_rank + 1) * rows]
    loss, grads = _loss_and_grads(model, local_tokens, num_global_tokens, dp_group_reduce=True)
    expected = local_view_of_full(model, ref_grads)
    destroy_model_parallel()

    report = {"loss": (loss, ref_loss), "grads": {}}
    for name, grad in grads.items():
        report["grads"][name] = (grad, expected[name])
    return report


LAYOUTS = {
    "tp2": dict(tensor_parallel=2),
    "ep2": dict(expert_parallel=2),
    "tp2_ep2": dict(tensor_parallel=2, expert_parallel=2),
    "tp2_etp2": dict(tensor_parallel=2, expert_tensor_parallel=2),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_single_process(layout, dispatcher):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reports = run_distributed(_parity_body, world_size=2, args=(LAYOUTS[layout], dispatcher, seed), timeout_s=240)
    for rank, report in enumerate(reports):
        loss, ref_loss = report["loss"]
        _assert_close(loss, ref_loss, f"seed {seed} rank {rank} loss")
        assert report["grads"], "no gradients compared"
        for name, (grad, expected) in report["grads"].items():
            assert expected.abs().max() > 0 or "experts" in name, f"{name}: reference gradient is all zero"
            _assert_close(grad, expected, f"seed {seed} rank {rank} grad {name}")
