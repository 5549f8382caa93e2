"""The online-softmax loop over a sequence's paged context, shared by the decode and prefill kernels."""

from __future__ import annotations

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(NEG - NEG) stays 1, never NaN


@triton.jit
def attend_paged_range(
    q,  # [BLOCK_M, BLOCK_D] the tile's queries (row m = query row qi[m] of one KV head's group)
    qi,  # [BLOCK_M] query row index of each tile row within its sequence
    first_pos,  # position of the sequence's first query row (seq_len - q_len)
    lo,
    hi,  # context positions [lo, hi) to attend to
    seq,
    kv_head,
    d,
    d_ok,  # [BLOCK_D] head-dim offsets and their mask
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] key cache, contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] value cache, contiguous
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32 physical block per logical block
    stride_bt,
    num_kv_heads,
    head_dim,
    block_size,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # do the dots in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input precision
):
    """Returns (m_i, l_i, acc): running max (log2 domain), running sum and un-normalised output."""
    m_i = tl.full([BLOCK_M], NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_stride_slot = num_kv_heads * head_dim
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        kv_off = slot[:, None] * kv_stride_slot + kv_head * head_dim + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = n_ok[None, :] & (n[None, :] <= first_pos + qi[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc
