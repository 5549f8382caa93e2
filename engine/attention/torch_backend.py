"""Torch reference attention over the paged KV cache: the kernels' oracle and the fallback CPU path.

Sequences with short queries (decode, speculative verification) are gathered into one padded batch
and run as a single SDPA call; long queries (prefill chunks) run one SDPA call each. Everything that
depends only on the step's shapes is computed once in `prepare` and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specfleet.engine.attention.base import AttentionMetadata

# Queries up to this many rows are batched together (padded); longer ones run alone.
SHORT_QUERY_MAX = 16


@dataclass
class _Short:
    batch: int
    qmax: int
    kmax: int
    query_rows: torch.Tensor | None  # [batch * qmax] rows of the flat query; None: identity
    key_slots: torch.Tensor | None  # [batch * kmax] slots to gather (batch 1)
    key_blocks: torch.Tensor | None  # [batch * kmax / block_size] whole blocks to gather (batch > 1)
    mask: torch.Tensor | None  # [batch, 1, qmax, kmax] bool, True = attend; None: attend to all
    out_src: torch.Tensor | None  # [n] rows of the padded output holding real queries
    out_dst: torch.Tensor | None  # [n] rows of the flat output they go to


@dataclass
class LongQuery:
    row_start: int
    row_end: int
    key_slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [q, seq_len] bool; None: plain causal (no cached prefix)


@dataclass
class _State:
    short: _Short | None
    longs: list[LongQuery]
    write_rows: torch.Tensor | None  # rows whose slot is >= 0, when some are padding


def _slots_for(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The slots of a sequence's first `length` tokens, from its block table row(s)."""
    offsets = torch.arange(block_size, dtype=torch.int64, device=block_table.device)
    slots = block_table.to(torch.int64).unsqueeze(-1) * block_size + offsets
    return slots.flatten(-2)[..., :length]


def split_by_query_len(meta: AttentionMetadata) -> tuple[list[int], list[int], list[int]]:
    """Sequence indices with short and with long queries, and every sequence's first query row."""
    starts = [0]
    for q in meta.query_lens_cpu:
        starts.append(starts[-1] + q)
    short_ids = [b for b, q in enumerate(meta.query_lens_cpu) if q <= SHORT_QUERY_MAX]
    long_ids = [b for b, q in enumerate(meta.query_lens_cpu) if q > SHORT_QUERY_MAX]
    return short_ids, long_ids, starts


def prepare_longs(meta: AttentionMetadata, long_ids: list[int], starts: list[int]) -> list[LongQuery]:
    device = meta.slot_mapping.device
    longs = []
    for b in long_ids:
        q, s = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        key_slots = _slots_for(meta.block_tables[b, : -(-s // meta.block_size)], s, meta.block_size)
        mask = None
        if s != q:
            i = torch.arange(q, device=device).unsqueeze(1)
            j = torch.arange(s, device=device).unsqueeze(0)
            mask = j <= (s - q) + i
        longs.append(LongQuery(starts[b], starts[b + 1], key_slots, mask))
    return longs


def padding_free_rows(meta: AttentionMetadata) -> torch.Tensor | None:
    """Rows whose slot is >= 0, when some rows are padding (slot -1); None when all are real."""
    if bool((meta.slot_mapping < 0).any()):
        return torch.nonzero(meta.slot_mapping >= 0).flatten()
    return None


def write_kv(key, value, k_cache, v_cache, slots: torch.Tensor, write_rows: torch.Tensor | None) -> None:
    if write_rows is not None:
        slots, key, value = slots[write_rows], key[write_rows], value[write_rows]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def forward_longs(query, k_cache, v_cache, longs: list[LongQuery], scale: float, out: torch.Tensor) -> None:
    """One SDPA call per long query (a prefill chunk), over its gathered keys, into `out`'s rows."""
    num_heads, head_dim = query.shape[-2:]
    num_kv_heads = k_cache.shape[-2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    for part in longs:
        q = query[part.row_start : part.row_end].transpose(0, 1).unsqueeze(0)
        k = k_flat.index_select(0, part.key_slots).transpose(0, 1).unsqueeze(0)
        v = v_flat.index_select(0, part.key_slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=part.mask,
            is_causal=part.mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[part.row_start : part.row_end] = o.squeeze(0).transpose(0, 1)


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        short_ids, long_ids, starts = split_by_query_len(meta)
        longs = prepare_longs(meta, long_ids, starts)
        short = self._prepare_short(meta, short_ids, starts, meta.slot_mapping.device) if short_ids else None
        meta.backend_state = _State(short, longs, padding_free_rows(meta))

    def _prepare_short(self, meta, ids, starts, device) -> _Short:
        qlens = [meta.query_lens_cpu[b] for b in ids]
        slens = [meta.seq_lens_cpu[b] for b in ids]
        batch, qmax, kmax = len(ids), max(qlens), max(slens)
        nblocks = -(-kmax // meta.block_size)
        tables = (
            meta.block_tables[ids, :nblocks] if len(ids) != meta.num_seqs else meta.block_tables[:, :nblocks]
        )
        if batch == 1:
            key_slots, key_blocks = _slots_for(tables, kmax, meta.block_size).reshape(-1), None
        else:  # whole blocks copy faster than single slots; the mask hides each table's tail
            key_slots, key_blocks = None, tables.reshape(-1).to(torch.int64)
            kmax = nblocks * meta.block_size

        uniform = all(q == qmax for q in qlens) and all(s == kmax for s in slens)
        mask = None
        if not (uniform and qmax == 1):
            q_len = torch.tensor(qlens, device=device).view(-1, 1, 1)
            s_len = torch.tensor(slens, device=device).view(-1, 1, 1)
            i = torch.arange(qmax, device=device).view(1, -1, 1)
            j = torch.arange(kmax, device=device).view(1, 1, -1)
            # Padded query rows (i >= q_len) see key 0 only, so they stay finite; they are dropped.
            mask = ((j <= s_len - q_len + i) & (i < q_len)) | (j == 0)
            mask = mask.unsqueeze(1)

        contiguous = ids == list(range(ids[0], ids[0] + len(ids))) and all(q == qmax for q in qlens)
        if contiguous:
            first = starts[ids[0]]
            rows = torch.arange(first, first + batch * qmax, device=device)
            identity = first == 0 and batch * qmax == starts[-1]
            return _Short(
                batch,
                qmax,
                kmax,
                None if identity else rows,
                key_slots,
                key_blocks,
                mask,
                None,
                None if identity else rows,
            )
        query_rows, out_src, out_dst = [], [], []
        for n, (b, q) in enumerate(zip(ids, qlens)):
            for i in range(qmax):
                query_rows.append(starts[b] + min(i, q - 1))
            out_src.extend(n * qmax + i for i in range(q))
            out_dst.extend(range(starts[b], starts[b] + q))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return _Short(
            batch,
            qmax,
            kmax,
            as_tensor(query_rows),
            key_slots,
            key_blocks,
            mask,
            as_tensor(out_src),
            as_tensor(out_dst),
        )

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping, meta.backend_state.write_rows)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        state: _State = meta.backend_state
        gqa = query.shape[-2] != k_cache.shape[-2]
        short = state.short
        if short is not None and not state.longs and short.query_rows is None:
            return self._short(query, k_cache, v_cache, short, scale, gqa)

        out = torch.empty_like(query)
        forward_longs(query, k_cache, v_cache, state.longs, scale, out)
        if short is not None:
            o = self._short(query.index_select(0, short.query_rows), k_cache, v_cache, short, scale, gqa)
            if short.out_src is not None:
                o = o.index_select(0, short.out_src)
            out.index_copy_(0, short.out_dst, o)
        return out

    @staticmethod
    def _short(query, k_cache, v_cache, short: _Short, scale: float, gqa: bool) -> torch.Tensor:
        num_heads, head_dim = query.shape[-2:]
        num_kv_heads = k_cache.shape[-2]
        shape = (short.batch, short.kmax, num_kv_heads, head_dim)
        if short.key_blocks is not None:
            k = k_cache.index_select(0, short.key_blocks).view(shape)
            v = v_cache.index_select(0, short.key_blocks).view(shape)
        else:
            k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, short.key_slots).view(shape)
            v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, short.key_slots).view(shape)
        q = query.view(short.batch, short.qmax, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=short.mask, scale=scale, enable_gqa=gqa
        )
        return o.transpose(1, 2).reshape(short.batch * short.qmax, num_heads, head_dim)
