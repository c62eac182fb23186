"""Smoke job: a tiny Qwen3-MoE GPTModel on Megatron-Core fits random next-token data for a few steps.

    python -m moe.smoke [--steps 30]        (1 process, CPU or GPU)
    torchrun --nproc-per-node 2 -m moe.smoke --tensor-parallel 2   (any TP/EP layout)

Prints the loss per step; the loss must fall (it memorises one fixed batch).
"""

from __future__ import annotations

import argparse
import time

import torch

from moe.architecture import Qwen3MoeArchitecture
from moe.cpu_shim import apply_cpu_shim, initialize_cpu_rng
from moe.device import use_cuda
from moe.model import build_model, forward_logits
from moe.optimizer import (
    OptimizerSettings,
    build_optimizer,
    finish_gradients,
    optimizer_step,
    wrap_data_parallel,
    zero_gradients,
)
from moe.parallel import ParallelLayout, destroy_model_parallel, init_distributed, initialize_model_parallel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, vocab_parallel_cross_entropy

    apply_cpu_shim()
    init_distributed()
    layout = ParallelLayout(tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel)
    initialize_model_parallel(layout)
    if use_cuda():
        # weights initialise on the GPU: Megatron's CUDA RNG tracker, as megagspo's setup_parallel seeds it
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)
    else:
        initialize_cpu_rng(args.seed)
    arch = Qwen3MoeArchitecture(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=128)
    model = build_model(arch, layout)
    ddp = wrap_data_parallel(model)
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=3e-3))
    device = next(model.parameters()).device
    tokens_BS = torch.randint(0, arch.vocab_size, (4, 33), generator=torch.Generator().manual_seed(args.seed))
    tokens_BS = tokens_BS.to(device)  # the model's device: CUDA on a GPU host
    first = last = None
    start = time.perf_counter()
    for step in range(args.steps):
        logits_BSV = forward_logits(model, tokens_BS[:, :-1])
        loss = vocab_parallel_cross_entropy(logits_BSV.transpose(0, 1).contiguous(),
                                            tokens_BS[:, 1:].t().contiguous()).mean()
        zero_gradients(ddp)
        loss.backward()
        # Every rank sees the same batch: Megatron's DDP averages the replicas
        finish_gradients(ddp)
        optimizer_step(optimizer)
        first = first if first is not None else loss.item()
        last = loss.item()
        if torch.distributed.get_rank() == 0:
            print(f"step {step:3d}  loss {last:.4f}", flush=True)
    if torch.distributed.get_rank() == 0:
        print(f"smoke: loss {first:.4f} -> {last:.4f} in {time.perf_counter() - start:.1f} s "
              f"(layout {layout})", flush=True)
    destroy_model_parallel()
    torch.distributed.destroy_process_group()
    if not last < first:
        raise SystemExit("smoke: the loss did not fall")


if __name__ == "__main__":
    main()
