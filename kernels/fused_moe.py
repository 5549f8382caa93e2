"""Fused mixture-of-experts on the GPU: the expert SwiGLU MLP as two grouped GEMMs over routed token blocks.

As vLLM's fused_moe: the (token, slot) pairs are sorted by expert and each expert's group is padded to a
multiple of ``BLOCK_M`` (`align_blocks`), so every program's ``BLOCK_M`` rows belong to one expert and it
reads that expert's weight tiles once for all of them. The first GEMM gathers token rows straight from the
hidden states (no copy per slot) into gate/up; SiLU-and-multiply runs between; the second GEMM scales each
row by its routing weight, and the top-k rows of a token are summed. kernels/moe_reference.py is the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from specfleet.kernels._launch import FLOAT_DTYPES, check_shape, check_tensor, kernel_for, next_pow2
from specfleet.kernels.moe_reference import expert_groups


@triton.jit
def _moe_gemm_kernel(
    out_ptr,  # [num_pairs, N] output, one row per (token, slot) pair
    a_ptr,  # [num_tokens, K] (GATHER: row = pair // TOP_K) or [num_pairs, K] activations
    w_ptr,  # [num_experts, N, K] expert weights as checkpoints store them, contiguous
    pair_ids_ptr,  # [num_padded] int32 pair per sorted row; num_pairs marks padding
    block_expert_ptr,  # [num_padded // BLOCK_M] int32 the expert of each row block
    scale_ptr,  # [num_pairs] float32 routing weight per pair (SCALE only)
    num_pairs,
    N,
    K,
    stride_a,
    stride_out,
    TOP_K: tl.constexpr,  # slots per token
    GATHER: tl.constexpr,  # a_ptr holds token rows, shared by a token's TOP_K pairs
    SCALE: tl.constexpr,  # multiply each output row by its pair's routing weight
    BLOCK_M: tl.constexpr,  # sorted rows per program, all one expert's
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # reduction step
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // TOP_K) if GATHER else pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_a + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * N * K + cols[None, :].to(tl.int64) * K + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the weight's rows are output columns
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (cols[None, :] < N),
    )


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's group padded to a multiple of `block_m` with the sentinel
    num_pairs (int32 [num_blocks * block_m]), and the expert of each block (int32 [num_blocks])."""
    order, counts = expert_groups(ids, num_experts)
    num_pairs = ids.numel()
    padded, experts, start = [], [], 0
    for e, count in enumerate(counts):
        if count:
            blocks = -(-count // block_m)
            group = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
            group[:count] = order[start : start + count]
            padded.append(group)
            experts += [e] * blocks
        start += count
    return torch.cat(padded), torch.tensor(experts, dtype=torch.int32, device=ids.device)


def _gemm(a, w, pair_ids, block_expert, num_pairs, top_k, scale, block_m) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = min(64, next_pow2(n))  # 64x64 fp32 tiles keep registers under the occupancy cliff
    block_k = max(16, min(64, next_pow2(k)))  # tl.dot needs K >= 16
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    kernel_for(_moe_gemm_kernel, a.device)[grid](
        out, a, w, pair_ids, block_expert, scale if scale is not None else out, num_pairs, n, k,
        a.stride(0), out.stride(0), TOP_K=top_k, GATHER=a.shape[0] != num_pairs, SCALE=scale is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,  # [tokens, hidden]
    w_gate_up: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows then up rows
    w_down: torch.Tensor,  # [experts, hidden, inter]
    weights: torch.Tensor,  # [tokens, top_k] routing weights
    ids: torch.Tensor,  # [tokens, top_k] expert ids
    block_m: int = 16,  # rows per program: decode steps route few tokens to each expert
) -> torch.Tensor:  # [tokens, hidden]
    device, (tokens, hidden) = x.device, x.shape
    experts, inter2 = w_gate_up.shape[0], w_gate_up.shape[1]
    check_tensor("x", x, device=device, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    check_tensor("w_gate_up", w_gate_up, device=device, dtypes=(x.dtype,), ndim=3, contiguous=True)
    check_tensor("w_down", w_down, device=device, dtypes=(x.dtype,), ndim=3, contiguous=True)
    check_shape("w_gate_up", w_gate_up, (experts, inter2, hidden))
    check_shape("w_down", w_down, (experts, hidden, inter2 // 2))
    check_shape("ids", ids, weights.shape)
    if tokens == 0:
        return torch.zeros_like(x)
    top_k, num_pairs = ids.shape[1], ids.numel()
    pair_ids, block_expert = align_blocks(ids, experts, block_m)
    gate, up = _gemm(x, w_gate_up, pair_ids, block_expert, num_pairs, top_k, None, block_m).chunk(2, -1)
    act = (F.silu(gate) * up).contiguous()
    scale = weights.float().flatten().contiguous()
    down = _gemm(act, w_down, pair_ids, block_expert, num_pairs, top_k, scale, block_m)
    return down.view(tokens, top_k, hidden).sum(dim=1)
