"""Attention over the paged KV cache with a sliding window and attention-logit soft-capping (Gemma 2/3).

A sliding layer's query at position p sees keys at positions p - window < j <= p (transformers'
`sliding_window_overlay`: the last `window` tokens, itself included); a full layer sees 0 ..= p. Soft-capping
(Gemma 2's `attn_logit_softcapping`) squashes each scaled score to cap * tanh(score / cap) before the
mask and the softmax, which SDPA cannot express: with a cap the scores are computed explicitly.

The paged KV layout and its writes are the backends' (attention/base.py); this module only reads the
cache, so it runs under any backend (torch, native, triton) on any device. A sliding layer whose cache
keeps only its window (engine/block_manager.py) is planned over the sliding pool's tables
(`meta.sliding`), whose entries before the window are the null block: no key there is ever gathered. `plan` is computed once per step
and window and shared by every layer of that kind: a sliding layer gathers only the keys inside its
window (a decode step reads `window` keys however long the sequence), short queries (decode,
verification) are batched into one padded call and long ones (prefill chunks) run one by one, in slices of
`LONG_ROWS` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specfleet.engine.attention.base import AttentionMetadata
from specfleet.engine.attention.torch_backend import SHORT_QUERY_MAX


@dataclass
class _Group:
    batch: int
    qmax: int
    kmax: int
    query_rows: torch.Tensor  # [batch * qmax] rows of the flat query (padding rows repeat a real one)
    key_slots: torch.Tensor  # [batch * kmax] cache slots (padding reads slot 0 and is masked)
    mask: torch.Tensor  # [batch, 1, qmax, kmax] bool, True = attend
    out_src: torch.Tensor  # rows of the padded output that hold real queries
    out_dst: torch.Tensor  # their rows in the flat output


@dataclass
class WindowPlan:
    groups: list[_Group]


# A prefill chunk's rows are attended in slices of at most this many: the explicit scores of a soft-capped
# layer are [heads, rows, keys] floats, so 512 rows over an 8k context hold 16 MB per head, not 256 MB; a
# sliding layer's slice also reads only its own rows' window of keys.
LONG_ROWS = 512


def plan(meta: AttentionMetadata, window: int | None) -> WindowPlan:
    """What every layer with this `window` (None: full attention) reads and masks in this step."""
    # (sequence, first flat row, query rows, context through the last of them) per query
    shorts: list[tuple[int, int, int, int]] = []
    longs: list[list[tuple[int, int, int, int]]] = []
    row = 0
    for b, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if 0 < q <= SHORT_QUERY_MAX:
            shorts.append((b, row, q, s))
        for first in range(0, q, LONG_ROWS) if q > SHORT_QUERY_MAX else ():
            rows = min(LONG_ROWS, q - first)
            longs.append([(b, row + first, rows, s - q + first + rows)])
        row += q
    groups = [_group(meta, queries, window) for queries in ([shorts] if shorts else []) + longs]
    return WindowPlan(groups)


def _group(meta: AttentionMetadata, queries: list[tuple[int, int, int, int]], window: int | None) -> _Group:
    device, bs = meta.slot_mapping.device, meta.block_size
    qlens = [q for _, _, q, _ in queries]
    slens = [s for _, _, _, s in queries]
    # The first key any of a query's rows can see: position (s - q) for its first row, less the window.
    firsts = [0 if window is None else max(0, s - q + 1 - window) for q, s in zip(qlens, slens)]
    qmax, kmax = max(qlens), max(s - f for s, f in zip(slens, firsts))
    query_rows: list[int] = []
    out_src: list[int] = []
    out_dst: list[int] = []
    slots: list[torch.Tensor] = []
    for n, ((b, start, q, s), f) in enumerate(zip(queries, firsts)):
        query_rows.extend(start + min(r, q - 1) for r in range(qmax))
        out_src.extend(n * qmax + r for r in range(q))
        out_dst.extend(range(start, start + q))
        positions = torch.arange(f, f + kmax, dtype=torch.int64).clamp_max(s - 1)
        table = meta.block_tables[b].to(torch.int64).cpu()
        slots.append(table[positions // bs] * bs + positions % bs)
    q_len = torch.tensor(qlens, device=device).view(-1, 1, 1)
    s_len = torch.tensor(slens, device=device).view(-1, 1, 1)
    first = torch.tensor(firsts, device=device).view(-1, 1, 1)
    i = torch.arange(qmax, device=device).view(1, -1, 1)
    key_pos = first + torch.arange(kmax, device=device).view(1, 1, -1)
    query_pos = s_len - q_len + i
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    # Padded query rows (i >= q) see their sequence's first gathered key only, so they stay finite.
    mask = (mask & (i < q_len)) | ((i >= q_len) & (key_pos == first))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return _Group(
        len(queries),
        qmax,
        kmax,
        as_tensor(query_rows),
        torch.cat(slots).to(device),
        mask.unsqueeze(1),
        as_tensor(out_src),
        as_tensor(out_dst),
    )


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: WindowPlan,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads, head_dim = query.shape[-2:]
    num_kv_heads = k_cache.shape[-2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(query)
    for g in step.groups:
        q = query.index_select(0, g.query_rows).view(g.batch, g.qmax, num_heads, head_dim).transpose(1, 2)
        k = k_flat.index_select(0, g.key_slots).view(g.batch, g.kmax, num_kv_heads, head_dim).transpose(1, 2)
        v = v_flat.index_select(0, g.key_slots).view(g.batch, g.kmax, num_kv_heads, head_dim).transpose(1, 2)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
        else:
            if num_heads != num_kv_heads:
                k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
                v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~g.mask, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)
        o = o.transpose(1, 2).reshape(g.batch * g.qmax, num_heads, head_dim)
        out.index_copy_(0, g.out_dst, o.index_select(0, g.out_src))
    return out
