"""Paged attention for decode and speculative verification (1 to k + 1 query rows per sequence).

One program per (sequence, KV head, context split). It stacks every query row of the sequence times
every query head of the KV head's group into one ``BLOCK_M`` tile (row ``m`` = query row ``m // GROUP``,
head ``kv_head * GROUP + m % GROUP``), so each K/V tile is read once for the whole group and all
speculative rows. Causal masking among the query rows: row ``i`` sees positions ``<= seq_len - q_len + i``.

Flash-decoding: with ``num_splits > 1`` the context is cut into ``num_splits`` ranges handled by
separate programs, which write un-normalised partial outputs plus their running max and sum; a second
kernel merges them. That keeps the GPU busy when few sequences (one long one) are decoding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specfleet.kernels._launch import is_interpreted, kernel_for, next_pow2, num_sms
from specfleet.kernels._paged_checks import check_paged_args
from specfleet.kernels._paged_softmax import NEG as _NEG
from specfleet.kernels._paged_softmax import attend_paged_range

MAX_DECODE_QUERY_LEN = 16  # longer queries belong to the prefill kernel
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] output, written when SPLIT is False
    part_acc_ptr,  # [num_splits, num_tokens, num_heads, BLOCK_D] fp32 partial sums (SPLIT only)
    part_ml_ptr,  # [num_splits, num_tokens, num_heads, 2] fp32 running max (log2) and sum (SPLIT only)
    q_ptr,  # [num_tokens, num_heads, head_dim] queries, head_dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] key cache, contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] value cache, contiguous
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32 physical block per logical block
    query_start_loc_ptr,  # [num_seqs + 1] int32 first query row of each sequence
    seq_lens_ptr,  # [num_seqs] int32 context length including this step's tokens
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_tokens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    split_len,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # >= max_query_len * GROUP, power of two, >= 16
    BLOCK_N: tl.constexpr,  # context tokens per inner-loop tile
    BLOCK_D: tl.constexpr,  # >= head_dim, power of two
    SPLIT: tl.constexpr,  # write partials for the reduction kernel instead of the output
    UPCAST: tl.constexpr,  # do the dots in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32 rounding)
):
    """One (sequence, KV head, context split) program: all of its query heads' rows against the split's
    context tiles, online softmax. Kept long because a Triton kernel is one compiled body: its 28 arguments
    are one per line with their shapes, and a helper @triton.jit function would hide the tile loop's
    loads from the reader without saving any code."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    qi = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = qi < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    m_i, l_i, acc = attend_paged_range(
        q,
        qi,
        first_pos,
        lo,
        hi,
        seq,
        kv_head,
        d,
        d_ok,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        stride_bt,
        num_kv_heads,
        head_dim,
        block_size,
        qk_scale,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        UPCAST,
        PRECISION,
    )

    valid = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (split * num_tokens + q_rows) * num_heads + head
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=valid)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] output
    part_acc_ptr,  # [num_splits, num_tokens, num_heads, BLOCK_D] fp32 partial sums
    part_ml_ptr,  # [num_splits, num_tokens, num_heads, 2] fp32 running max (log2) and sum
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,  # >= num_splits, power of two
    BLOCK_D: tl.constexpr,  # >= head_dim, power of two
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    part = (s.to(tl.int64) * num_tokens + token) * num_heads + head
    m_s = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=_NEG)
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m_s, 0)
    w = tl.exp2(m_s - m_max)
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def pick_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough context splits to give every SM a few programs, never a split shorter than 256 tokens."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-4 * num_sms(device) // programs)
    return max(1, min(wanted, -(-max_seq_len // 256), 64))


def paged_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,  # None: pick from the device and the shapes
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Decode attention over the paged KV cache: checks the arguments, picks the block sizes and the
    context splits, launches the kernel and, with splits, the merge. Kept long because the two launches
    pass each pointer, stride and block size one per line (about half of its lines), in the order of the
    kernel's signature, so that a reader can check them side by side."""
    num_heads, num_kv_heads, head_dim = check_paged_args(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out
    )
    if not 1 <= max_query_len <= MAX_DECODE_QUERY_LEN:
        raise ValueError(
            f"max_query_len={max_query_len} must be in 1..{MAX_DECODE_QUERY_LEN} for the decode "
            "kernel; use paged_prefill_attention for longer queries"
        )
    device = query.device
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = pick_num_splits(num_seqs, num_kv_heads, max_seq_len, device)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    interpreted = is_interpreted(device)
    block_m = max(16, next_pow2(max_query_len * group))
    block_n = 64 if interpreted else (64 if head_dim <= 64 else 32)
    block_d = next_pow2(max(head_dim, 16))
    split_len = -(-max(max_seq_len, 1) // num_splits)
    split_len = -(-split_len // block_n) * block_n
    num_splits = -(-max(max_seq_len, 1) // split_len)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (num_splits, num_tokens, num_heads, block_d), dtype=torch.float32, device=device
        )
        part_ml = torch.empty((num_splits, num_tokens, num_heads, 2), dtype=torch.float32, device=device)
    else:
        part_acc = part_ml = out  # unused
    num_warps = 4 if block_m * block_d >= 128 * 64 else 2
    kernel_for(_paged_decode_kernel, device)[(num_seqs, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_ml,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        split_len,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        UPCAST=interpreted,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=2,
    )
    if split:
        kernel_for(_merge_splits_kernel, device)[(num_tokens, num_heads)](
            out,
            part_acc,
            part_ml,
            out.stride(0),
            out.stride(1),
            num_tokens,
            num_heads,
            head_dim,
            num_splits,
            BLOCK_S=next_pow2(num_splits),
            BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )
    return out
