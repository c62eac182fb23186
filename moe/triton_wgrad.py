"""The experts' weight gradient accumulated INTO Megatron DDP's fp32 `main_grad` by one grouped Triton GEMM:
for every local expert e, main_e[N, K] += dy[rows of e]^T @ x[rows of e] (the `triton` mode of
moe.experts.WGRAD_ACCUMULATIONS).

Shape legend: T routed token copies (sorted by expert), E local experts, N output and K input features of the
linear (fc1: N = F, K = H; fc2: N = H, K = I).

Why: the `add` mode writes a bf16 [E, N, K] gradient from torch's grouped GEMM and then adds it into the fp32
[E, N, K] view of main_grad; on an H100 at Qwen3-30B-A3B width (4 layers, 128 experts, 4 micro-batches) that
add was the step's top kernel (44.4 ms per step: a non-vectorised TensorIterator add into the strided view).
Here each output tile keeps its fp32 sum in registers over the expert's rows and adds it to the old main_grad
tile in the epilogue: main_grad is read and written once, and no bf16 gradient exists.

The expert boundaries are read on the device (`offs_E`: int32 end rows, moe.experts.expert_offsets): no host
sync; an expert with no row leaves its main_grad untouched (adding zeros would change nothing). main_grad is
either the zero-copy [E, N, K] view of DDP's buffer (any expert stride; moe.experts.expert_weights_ENK) or,
where the buffer does not allow that view, E separate [N, K] tensors reached through a table of pointers.

Accumulation is fp32 (`tl.dot` into an fp32 accumulator); fp32 operands run at IEEE precision (torch's fp32
matmul default), not TF32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.triton_support import require_triton, tl, triton

CHOICE = "expert weight-gradient accumulation 'triton'"


@dataclass(frozen=True)
class WgradTiles:
    """Tile sizes. The default targets H100/H200 bf16 wgmma: a 128 x 128 fp32 output tile per program (8 warps),
    the reduction over the expert's rows in steps of 64, 3 pipeline stages (2 x 16 KB of operands per stage).
    Compiled here for sm_90 with triton 3.7.1 (no GPU; 16-divisible strides as the JIT specialises them): wgmma,
    cp.async pipelining, 16-byte epilogue loads / stores, 182 registers and 96 KB shared memory, no spills (one
    program per SM); 128 x 64 with 4 warps: 180 registers, 72 KB (two per SM). Which is faster is for a GPU to
    say: benchmarks/bench_expert_kernels.py times up to four configurations at Qwen3-30B-A3B shapes.
    No autotuning: the kernel accumulates in place, so every autotune trial would add into main_grad again."""

    block_n: int = 128
    block_k: int = 128
    block_t: int = 64
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_TILES = WgradTiles()
# fp32 operands (the fp32 GPU tests) take IEEE FMA, not tensor cores: half the tile, a quarter of the shared memory
FP32_TILES = WgradTiles(block_n=64, block_k=64, block_t=32, num_warps=4, num_stages=2)
# offsets inside one expert's rows are 32-bit (the kernel's first row of each expert is 64-bit)
_MAX_OFFSET = 2**31 - 1

if triton is not None:
    @triton.jit
    def _grouped_wgrad_kernel(dy_ptr, x_ptr, main_ptr, offs_ptr, N, K, stride_dy_t, stride_x_t, stride_main_e,
                              stride_main_n, MAIN_IS_TABLE: tl.constexpr, FP32_IEEE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
        tiles_k = tl.cdiv(K, BLOCK_K)
        pid_n = tl.program_id(0) // tiles_k
        pid_k = tl.program_id(0) % tiles_k
        e = tl.program_id(1)
        end = tl.load(offs_ptr + e)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        if end > start:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
            rt = tl.arange(0, BLOCK_T)
            # 64-bit only for the expert's first row; offsets inside one expert stay 32-bit
            dy_e = dy_ptr + start.to(tl.int64) * stride_dy_t
            x_e = x_ptr + start.to(tl.int64) * stride_x_t
            count = end - start
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for t0 in range(0, count, BLOCK_T):
                rows = t0 + rt
                dyT = tl.load(dy_e + rows[None, :] * stride_dy_t + rn[:, None],
                              mask=(rows[None, :] < count) & (rn[:, None] < N), other=0.0)
                x = tl.load(x_e + rows[:, None] * stride_x_t + rk[None, :],
                            mask=(rows[:, None] < count) & (rk[None, :] < K), other=0.0)
                if FP32_IEEE:
                    acc = tl.dot(dyT, x, acc, input_precision="ieee")
                else:
                    acc = tl.dot(dyT, x, acc)
            if MAIN_IS_TABLE:
                # 16-byte aligned (the launcher checks): vector loads and stores, as for the view
                main_e = tl.multiple_of(tl.load(main_ptr + e).to(tl.pointer_type(tl.float32)), 16)
            else:
                main_e = main_ptr + e.to(tl.int64) * stride_main_e
            ptrs = main_e + rn[:, None].to(tl.int64) * stride_main_n + rk[None, :]
            inside = (rn[:, None] < N) & (rk[None, :] < K)
            tl.store(ptrs, tl.load(ptrs, mask=inside, other=0.0) + acc, mask=inside)


def _main_operand(mains, e: int, n: int, k: int, device):
    """(pointer argument, expert stride, row stride, is a pointer table) for the [E, N, K] tensor or the list."""
    if torch.is_tensor(mains):
        if mains.shape != (e, n, k) or mains.dtype != torch.float32 or mains.stride(2) != 1 \
                or mains.device != torch.device(device):
            raise ValueError(f"grouped_wgrad_accumulate: main_grad must be fp32 [E, N, K] = [{e}, {n}, {k}] with "
                             f"contiguous rows on {device}; got {mains.dtype} {tuple(mains.shape)} strides "
                             f"{mains.stride()} on {mains.device}")
        # every (expert, row) a region of its own: overlapping ones would be two programs adding into the same
        # main_grad elements at once (a race, not a sum)
        if (n > 1 and mains.stride(1) < k) or (e > 1 and mains.stride(0) < (n - 1) * mains.stride(1) + k):
            raise ValueError(f"grouped_wgrad_accumulate: the [E, N, K] main_grad's experts or rows overlap "
                             f"(strides {mains.stride()} for [{e}, {n}, {k}])")
        return mains, mains.stride(0), mains.stride(1), False
    if len(mains) != e or any(m.shape != (n, k) or m.dtype != torch.float32 or m.stride(1) != 1
                              or m.device != device or m.data_ptr() % 16 for m in mains):
        raise ValueError(f"grouped_wgrad_accumulate: main_grads must be {e} fp32 [{n}, {k}] tensors with contiguous "
                         f"rows, 16-byte aligned, on {device}; got "
                         f"{[(m.dtype, tuple(m.shape), m.stride(), m.data_ptr() % 16) for m in mains]}")
    strides = {m.stride(0) for m in mains}
    if len(strides) != 1 or (n > 1 and min(strides) < k):
        raise ValueError(f"grouped_wgrad_accumulate: the main_grads' row strides must be equal and >= {k}: "
                         f"{sorted(strides)}")
    if len({m.data_ptr() for m in mains}) != e:  # one tensor twice: two programs adding into it at once
        raise ValueError("grouped_wgrad_accumulate: the main_grads list holds one tensor more than once")
    table = torch.tensor([m.data_ptr() for m in mains], dtype=torch.int64)
    if torch.device(device).type == "cuda":  # from pinned memory: the copy does not wait for the stream
        table = table.pin_memory().to(device, non_blocking=True)
    return table, 0, strides.pop(), True


def grouped_wgrad_accumulate(mains, dy_TN: torch.Tensor, x_TK: torch.Tensor, offs_E: torch.Tensor,
                             tiles: WgradTiles | None = None) -> None:
    """mains[e] += dy_TN[rows of e]^T @ x_TK[rows of e] for every expert e (rows of e: offs_E[e-1]:offs_E[e]).
    `mains`: an fp32 [E, N, K] tensor (any expert stride, rows contiguous: the view of DDP's buffer) or a list of
    E fp32 [N, K] tensors. dy / x: the same 16- or 32-bit float dtype. `tiles`: None picks
    DEFAULT_TILES (FP32_TILES for fp32 operands)."""
    require_triton(CHOICE, dy_TN.device)
    # rows must be contiguous (the kernel's innermost index has stride 1); a copy only for a strided operand
    dy_TN = dy_TN if dy_TN.stride(-1) == 1 else dy_TN.contiguous()
    x_TK = x_TK if x_TK.stride(-1) == 1 else x_TK.contiguous()
    (t, n), k = dy_TN.shape, x_TK.shape[1]
    e = offs_E.shape[0]
    if x_TK.shape[0] != t or x_TK.dtype != dy_TN.dtype or x_TK.device != dy_TN.device \
            or offs_E.dtype != torch.int32 or offs_E.device != dy_TN.device:
        raise ValueError(f"grouped_wgrad_accumulate: dy {dy_TN.dtype} {tuple(dy_TN.shape)}, x {x_TK.dtype} "
                         f"{tuple(x_TK.shape)} on {x_TK.device}, offs {offs_E.dtype} on {offs_E.device}: expected "
                         f"equal dtypes and token counts and int32 offsets, all on {dy_TN.device}")
    main, stride_e, stride_n, is_table = _main_operand(mains, e, n, k, dy_TN.device)
    if t == 0 or e == 0:
        return  # no row: nothing to add (and no zero-sized launch)
    if t * max(dy_TN.stride(0), x_TK.stride(0)) > _MAX_OFFSET:
        raise ValueError(f"grouped_wgrad_accumulate: {t} rows of strides {dy_TN.stride(0)} / {x_TK.stride(0)} "
                         "overflow the kernel's 32-bit offsets inside an expert")
    if tiles is None:
        tiles = FP32_TILES if dy_TN.dtype == torch.float32 else DEFAULT_TILES
    grid = (triton.cdiv(n, tiles.block_n) * triton.cdiv(k, tiles.block_k), e)
    _grouped_wgrad_kernel[grid](
        dy_TN, x_TK, main, offs_E, n, k, dy_TN.stride(0), x_TK.stride(0), stride_e, stride_n,
        MAIN_IS_TABLE=is_table, FP32_IEEE=dy_TN.dtype == torch.float32, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, BLOCK_T=tiles.block_t, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
