"""Multi-LoRA on the GPU: Triton shrink and expand kernels over a batch that mixes adapters and the base model.

The contract of vLLM's (Punica lineage) shrink/expand ops, written afresh: each token names its adapter
(`token_lora`, -1 for none); the tokens are sorted by adapter once per step (`LoraMapping`: the sorted token
indices, each adapter's start in them, and the adapters present), and both kernels run on a grid of
(row tiles x column tiles, slices, adapters present). A program takes BLOCK_M tokens of one adapter, so it
reads that adapter's weight tile once for all of them; tiles past an adapter's token count exit at once
(the grid is sized by the step's token count, not by the largest group, so building it needs no device
sync). Tokens without an adapter are in no group: their rows are never read or written.

- shrink: s[slice, t] = x[t] @ a[slice, lora(t)]^T (float32 [slices, T, rank]). With SPLIT_K > 1 each
  program sums a K range and adds it atomically, which keeps a decode step's few tokens from leaving most
  of the GPU idle while one program walks all of H.
- expand: out[t, slice_starts[slice] + n] += s[slice, t] @ b[slice, lora(t), n]^T, per slice of a fused
  projection (q/k/v, gate/up): each slice writes its own columns of the fused output.

Layouts (kernels/lora_reference.py, the oracle): a [slices, loras, rank, in], b [slices, loras, width, rank]
with ranks zero-padded to the batch's largest (at most MAX_RANK) and rows to the widest slice. The LoRA scale
is folded into B, as in the CPU kernel. On CPU tensors the kernels run through Triton's interpreter
(kernels/_launch.py), which is how tests/kernels/test_lora_shrink_expand.py checks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from specfleet.kernels._launch import FLOAT_DTYPES, check_shape, check_tensor, kernel_for, next_pow2

MAX_RANK = (
    64  # vLLM's common --max-lora-rank ceiling for its Triton ops; one [BLOCK_M, 64] fp32 tile per program
)
BLOCK_M = 16  # tokens per program: tl.dot's minimum, and a decode step gives an adapter a handful of tokens


@dataclass(frozen=True)
class LoraMapping:
    """A step's tokens grouped by adapter: group g (adapter lora_ids[g]) owns tokens[starts[g]:starts[g+1]]."""

    tokens: torch.Tensor  # [n] int32: token indices, sorted by adapter; tokens without one are left out
    starts: torch.Tensor  # [groups + 1] int32
    lora_ids: torch.Tensor  # [groups] int32: the adapter (index into the stacked weights) of each group
    num_tokens: int  # T, the step's token count (bounds the grid)

    @classmethod
    def of(cls, token_lora: torch.Tensor) -> LoraMapping:
        """From token_lora [T] (adapter index per token, -1 for none)."""
        if token_lora.dim() != 1:
            raise ValueError(f"token_lora must be 1-D [tokens], got shape {tuple(token_lora.shape)}")
        order = torch.argsort(token_lora, stable=True)
        ids, counts = torch.unique_consecutive(token_lora[order], return_counts=True)
        keep = ids >= 0
        skipped = int(counts[~keep].sum()) if bool((~keep).any()) else 0  # the -1s sort first
        starts = torch.zeros(int(keep.sum()) + 1, dtype=torch.int32, device=token_lora.device)
        torch.cumsum(counts[keep], 0, out=starts[1:])
        return cls(order[skipped:].int(), starts, ids[keep].int(), token_lora.numel())

    @classmethod
    def of_groups(cls, rows: torch.Tensor, starts: torch.Tensor, num_tokens: int) -> LoraMapping:
        """From rows already grouped (kernels/cpu_lora.RowGroups): group g is adapter g."""
        groups = starts.numel() - 1
        device = rows.device
        return cls(
            rows.to(device, torch.int32),
            starts.to(device, torch.int32),
            torch.arange(groups, dtype=torch.int32, device=device),
            num_tokens,
        )

    @property
    def groups(self) -> int:
        return self.lora_ids.numel()


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] activations
    a_ptr,  # [slices, loras, R, K]
    s_ptr,  # [slices, T, R] float32 (zeroed when SPLIT_K > 1)
    tokens_ptr,  # [n] int32 tokens sorted by adapter
    starts_ptr,  # [groups + 1] int32
    lora_ids_ptr,  # [groups] int32
    K,
    R,
    stride_xt,
    stride_as,
    stride_al,
    stride_ar,
    stride_ss,
    stride_st,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_k = pid // SPLIT_K, pid % SPLIT_K
    sl, g = tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    first = start + pid_m * BLOCK_M
    if first >= end:  # this adapter has fewer tokens than the grid's tiles
        return
    lora = tl.load(lora_ids_ptr + g).to(tl.int64)
    offs = first + tl.arange(0, BLOCK_M)
    valid = offs < end
    tok = tl.load(tokens_ptr + offs, mask=valid, other=0).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    a_base = a_ptr + sl * stride_as + lora * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(
            x_ptr + tok[:, None] * stride_xt + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
        )
        at = tl.load(
            a_base + ranks[None, :] * stride_ar + ks[:, None],
            mask=(ranks[None, :] < R) & (ks[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A's rows are the rank
        acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
    out = s_ptr + sl * stride_ss + tok[:, None] * stride_st + ranks[None, :]
    mask = valid[:, None] & (ranks[None, :] < R)
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def _expand_kernel(
    s_ptr,  # [slices, T, R] float32
    b_ptr,  # [slices, loras, W, R]
    out_ptr,  # [T, N] updated in place
    tokens_ptr,
    starts_ptr,
    lora_ids_ptr,
    slice_starts_ptr,  # [slices + 1] int32: each slice's first output column
    R,
    W,
    stride_ss,
    stride_st,
    stride_bs,
    stride_bl,
    stride_bw,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(W, BLOCK_N)
    pid_m, pid_n = pid // tiles_n, pid % tiles_n
    sl, g = tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    first = start + pid_m * BLOCK_M
    col0 = tl.load(slice_starts_ptr + sl)
    width = tl.load(slice_starts_ptr + sl + 1) - col0
    if first >= end or pid_n * BLOCK_N >= width:  # past the adapter's tokens, or this slice is narrower
        return
    lora = tl.load(lora_ids_ptr + g).to(tl.int64)
    offs = first + tl.arange(0, BLOCK_M)
    valid = offs < end
    tok = tl.load(tokens_ptr + offs, mask=valid, other=0).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(
        s_ptr + sl * stride_ss + tok[:, None] * stride_st + ranks[None, :],
        mask=valid[:, None] & (ranks[None, :] < R),
        other=0.0,
    )
    bt = tl.load(
        b_ptr + sl * stride_bs + lora * stride_bl + cols[None, :].to(tl.int64) * stride_bw + ranks[:, None],
        mask=(cols[None, :] < width) & (ranks[:, None] < R),
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: B's rows are output columns
    delta = tl.dot(s, bt.to(tl.float32), input_precision="ieee")
    out = out_ptr + tok[:, None] * stride_ot + col0 + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < width)
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _check_weights(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    check_tensor(name, w, device=x.device, dtypes=FLOAT_DTYPES, ndim=4, contiguous=True)
    if w.shape[-1 if name == "b" else 2] > MAX_RANK:
        raise ValueError(f"{name}.shape={tuple(w.shape)}: rank exceeds MAX_RANK={MAX_RANK}")


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [slices, loras, R, K]
    mapping: LoraMapping,
    split_k: int | None = None,
) -> torch.Tensor:  # [slices, T, R] float32; rows of tokens without an adapter are not written
    check_tensor("x", x, device=x.device, dtypes=FLOAT_DTYPES, ndim=2)
    _check_weights(x, a, "a")
    slices, _, rank, k = a.shape
    if x.shape[1] != k:
        raise ValueError(f"x.shape={tuple(x.shape)} and a.shape={tuple(a.shape)} disagree on K={k}")
    if x.shape[0] != mapping.num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, the mapping {mapping.num_tokens}")
    if split_k is None:
        # A few tokens per adapter make few row tiles: split K so that a wide hidden size still fills the
        # SMs (8 x 512 columns at H=4096); the interpreter, which runs programs one by one, gains nothing.
        split_k = 1 if x.device.type != "cuda" or k < 1024 else min(8, k // 512)
    block_k = 64 if x.device.type != "cuda" else 128  # 16x128 fp32 x tile + 128x64 A tile stay in registers
    alloc = torch.zeros if split_k > 1 else torch.empty
    s = alloc(slices, x.shape[0], rank, dtype=torch.float32, device=x.device)
    if mapping.groups == 0 or x.shape[0] == 0:
        return s
    grid = (triton.cdiv(mapping.num_tokens, BLOCK_M) * split_k, slices, mapping.groups)
    kernel_for(_shrink_kernel, x.device)[grid](
        x, a, s, mapping.tokens, mapping.starts, mapping.lora_ids, k, rank,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), s.stride(0), s.stride(1),
        SPLIT_K=split_k, BLOCK_M=BLOCK_M, BLOCK_R=max(16, next_pow2(rank)), BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return s


def lora_expand(
    out: torch.Tensor,  # [T, N] updated in place
    s: torch.Tensor,  # [slices, T, R] float32 (lora_shrink's)
    b: torch.Tensor,  # [slices, loras, W, R]
    slice_starts: Sequence[int]
    | torch.Tensor,  # [slices + 1]: slice i writes columns [starts[i], starts[i+1])
    mapping: LoraMapping,
) -> torch.Tensor:
    check_tensor("out", out, device=out.device, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("s", s, device=out.device, dtypes=(torch.float32,), ndim=3, contiguous=True)
    _check_weights(out, b, "b")
    slices, _, width, rank = b.shape
    check_shape("s", s, (slices, out.shape[0], rank))
    if isinstance(slice_starts, torch.Tensor):  # already on the device (the engine checks it when it stacks)
        starts = slice_starts
    else:
        bounds = [int(v) for v in slice_starts]
        if len(bounds) != slices + 1 or bounds[0] < 0 or bounds[-1] > out.shape[1]:
            raise ValueError(
                f"slice_starts={bounds} must be {slices + 1} column starts within out's {out.shape[1]} columns"
            )
        if any(not 0 <= bounds[i + 1] - bounds[i] <= width for i in range(slices)):
            raise ValueError(f"slice_starts={bounds} must rise by at most b's width {width} per slice")
        starts = torch.tensor(bounds, dtype=torch.int32, device=out.device)
    if mapping.groups == 0 or out.shape[0] == 0:
        return out
    block_n = min(64, max(16, next_pow2(width)))  # 16 rows x 64 columns: one fp32 tile per program
    grid = (triton.cdiv(mapping.num_tokens, BLOCK_M) * triton.cdiv(width, block_n), slices, mapping.groups)
    kernel_for(_expand_kernel, out.device)[grid](
        s, b, out, mapping.tokens, mapping.starts, mapping.lora_ids, starts, rank, width,
        s.stride(0), s.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(rank)), num_warps=4,
    )  # fmt: skip
    return out
