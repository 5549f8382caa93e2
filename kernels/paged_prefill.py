"""Prefill attention over the paged KV cache, for (chunked) prefill and mixed batches.

A chunk of ``q_len`` new tokens, already written to the cache, attends causally to itself and to the
``seq_len - q_len`` tokens cached before it (a prefix-cache hit or earlier chunks). One program per
(sequence, KV head, query tile); a tile holds ``BLOCK_M // GROUP`` query rows times the ``GROUP`` query
heads sharing the KV head, so K/V tiles are read once per group. Programs whose tile lies past their
sequence's query rows exit at once; each tile stops reading keys after its last row's position.
Any query length works (decode rows too), so the backend sends a whole mixed batch here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specfleet.kernels._launch import is_interpreted, kernel_for, next_pow2
from specfleet.kernels._paged_checks import check_paged_args
from specfleet.kernels._paged_softmax import attend_paged_range
from specfleet.kernels.attention_reference import paged_attention_reference

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] output
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
    num_kv_heads,
    head_dim,
    block_size,
    GROUP: tl.constexpr,  # query heads per KV head
    ROWS: tl.constexpr,  # query rows per tile = BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,  # (row, head) pairs per tile, power of two, >= 16
    BLOCK_N: tl.constexpr,  # context tokens per inner-loop tile
    BLOCK_D: tl.constexpr,  # >= head_dim, power of two
    UPCAST: tl.constexpr,  # do the dots in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32 rounding)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * ROWS >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    qi = tile * ROWS + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < ROWS * GROUP) & (qi < q_len)
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

    hi = tl.minimum(first_pos + (tile + 1) * ROWS, seq_len)  # one past the tile's last row position
    m_i, l_i, acc = attend_paged_range(
        q,
        qi,
        first_pos,
        0,
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

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_query_len: int,
    block_m: int | None = None,  # None: 64 on GPU (128 when interpreted, fewer programs)
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads, num_kv_heads, head_dim = check_paged_args(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out
    )
    if max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len} must be >= 1")
    device = query.device
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    interpreted = is_interpreted(device)
    if block_m is None:
        block_m = 128 if interpreted else 64
    block_m = max(16, next_pow2(max(block_m, group)))
    rows = block_m // group
    block_d = next_pow2(max(head_dim, 16))
    block_n = 64 if interpreted or head_dim <= 64 else 32
    num_tiles = -(-max_query_len // rows)
    kernel_for(_paged_prefill_kernel, device)[(num_seqs, num_kv_heads, num_tiles)](
        out,
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
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        GROUP=group,
        ROWS=rows,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=interpreted,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if block_d <= 64 else 8,
        num_stages=2,
    )
    return out


def paged_prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return paged_attention_reference(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
