"""4-bit grouped weight-only matmul on CUDA: ``y = x @ W.T`` with W an AWQ or GPTQ weight (`QuantTensor`).

The weight is repacked once into GPTQ's layout, the one a dequantize-in-the-loop kernel reads best:
``qweight`` [K / 8, N] int32 with eight consecutive input rows per word, so one load of a [BLOCK_K / 8,
BLOCK_N] tile gives a [BLOCK_K, BLOCK_N] tile of codes after a shift and a mask; ``scales`` and ``mins``
[K / G, N] in the activation dtype. Each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K,
dequantizing ``q * scale + min`` in registers before `tl.dot`; the weight is read once per M tile, so at
decode (M <= 16) the kernel is a GEMV that streams half a byte per weight. Split-K (as vLLM's
awq_gemm_triton) cuts K over several programs when the N tiles alone cannot fill the GPU.

Act-order (GPTQ desc_act) weights gather x's columns with the weight's permutation before the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specfleet.kernels._launch import FLOAT_DTYPES, check_tensor, is_interpreted, kernel_for, num_sms
from specfleet.kernels.quantized import QuantTensor


@triton.jit
def _q4_matmul_kernel(
    y_ptr,  # [M, N] output (fp32 when SPLIT_K > 1: partial sums are added atomically)
    x_ptr,  # [M, K] activations, K contiguous
    qw_ptr,  # [K / 8, N] int32: bits 4j..4j+3 of word (i, n) = code of input row 8i + j, column n
    s_ptr,  # [K / G, N] scales
    mn_ptr,  # [K / G, N] mins: W.T[k, n] = code * scale + min
    M,
    N,
    K,
    G,
    stride_xm,
    stride_ym,
    stride_qk,
    stride_sg,
    BLOCK_M: tl.constexpr,  # rows of x per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # input rows per step, a multiple of 8 dividing G
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each a slice of K
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" for fp32 activations)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        words = tl.load(
            qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0,
        )
        codes = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        group = k0 // G  # BLOCK_K divides G: one group per step
        s = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0)
        mn = tl.load(mn_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0)
        w = codes.to(tl.float32) * s.to(tl.float32)[None, :] + mn.to(tl.float32)[None, :]
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


def pack_gptq_layout(q: QuantTensor, dtype: torch.dtype, device: torch.device):
    """QuantTensor (4-bit) -> (qweight [K / 8, N] int32, scales, mins [K / G, N] in `dtype`) on device."""
    if q.bits != 4 or q.mins is None:
        raise ValueError(f"{q.fmt}: the Triton kernel runs 4-bit codes with zero points, got bits={q.bits}")
    n, k = q.shape
    if k % 8:
        raise ValueError(f"{q.fmt}: input size {k} must be a multiple of 8")
    codes = q.codes.t().to(torch.int64).reshape(k // 8, 8, n)
    words = (codes << (torch.arange(8).view(1, 8, 1) * 4)).sum(dim=1)
    qweight = (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # to two's complement
    to = dict(device=device)
    return (
        qweight.contiguous().to(**to),
        q.scales.t().contiguous().to(dtype=dtype, **to),
        q.mins.t().contiguous().to(dtype=dtype, **to),
    )


def q4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantized weight (the layout of `pack_gptq_layout`)."""
    device = x.device
    check_tensor("x", x, device=device, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("qweight", qweight, device=device, dtypes=(torch.int32,), ndim=2, contiguous=True)
    check_tensor("scales", scales, device=device, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    check_tensor("mins", mins, device=device, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    m, k = x.shape
    n = qweight.shape[1]
    if (
        qweight.shape[0] * 8 != k
        or k % group_size
        or scales.shape != (k // group_size, n)
        or mins.shape != scales.shape
    ):
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
            f"{tuple(scales.shape)}, mins {tuple(mins.shape)}, group_size {group_size}"
        )
    block_k = next(b for b in (64, 32, 16, 8) if group_size % b == 0) if group_size % 8 == 0 else None
    if block_k is None:
        raise ValueError(f"group_size={group_size} must be a multiple of 8")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # Split K only while the output tiles leave the SMs idle and each slice keeps several steps; 32 is
    # vLLM's ceiling for its AWQ kernel (beyond it the atomic adds cost more than the parallelism gives).
    split_k = 1
    while split_k < 32 and tiles * split_k * 2 <= num_sms(device) and k // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    if is_interpreted(device):
        split_k = 1  # the interpreter has no atomics worth testing against; the split runs on CUDA checks
    y = (
        torch.zeros(m, n, device=device, dtype=torch.float32)
        if split_k > 1
        else torch.empty(m, n, device=device, dtype=x.dtype)
    )
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    kernel_for(_q4_matmul_kernel, device)[grid](
        y,
        x,
        qweight,
        scales,
        mins,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        y.stride(0),
        qweight.stride(0),
        scales.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return y.to(x.dtype)


class TritonQuantLinear:
    """``x @ W.T (+ bias) (+ residual)`` for a 4-bit AWQ/GPTQ weight on CUDA (or CPU, interpreted)."""

    def __init__(
        self,
        weight: QuantTensor,
        bias: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.qweight, self.scales, self.mins = pack_gptq_layout(weight, dtype, device)
        self.perm = None if weight.perm is None else weight.perm.to(device)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        y = q4_matmul(x, self.qweight, self.scales.to(x.dtype), self.mins.to(x.dtype), self.group_size)
        if self.bias is not None:
            y += self.bias
        return y if residual is None else y.add_(residual)
