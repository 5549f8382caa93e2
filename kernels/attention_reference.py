"""Plain torch reference for attention over the paged KV cache, shared by the decode and prefill ops.

Semantics (see ``specfleet.engine.attention.base``): sequence ``b`` owns query rows
``query_start_loc[b] : query_start_loc[b + 1]``; they are the last ``query_len`` of its ``seq_len``
context, so row ``i`` sits at position ``seq_len - query_len + i`` and sees keys ``0 ..= position``.
Keys are found through the block table: token ``j`` lives in block ``block_tables[b, j // block_size]``
at offset ``j % block_size``. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
Computed in float32, one sequence at a time: slow and obvious on purpose.
"""

from __future__ import annotations

import torch


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    num_heads, head_dim = query.shape[-2:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=query.device)
        blocks = block_tables[b].to(torch.int64)[pos // block_size]
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [seq, heads, d]
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        q = query[q_lo:q_hi].float()  # [q_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        visible = pos[None, :] <= q_pos[:, None]  # [q_len, seq]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.to(query.dtype)
