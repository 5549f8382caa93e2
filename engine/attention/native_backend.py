"""Native CPU attention (``attention_backend="native"``, the CPU default when the kernels build).

Short queries (decode, speculative verification: up to SHORT_QUERY_MAX rows) run in one native call
that reads the paged KV cache in place, one (sequence, kv head) per task, and writes straight into
the output rows; nothing is gathered or padded. Long queries (prefill chunks) are compute-bound and
keep the torch path: one SDPA call each over their gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.attention.base import AttentionMetadata
from specfleet.engine.attention.torch_backend import (
    LongQuery,
    forward_longs,
    padding_free_rows,
    prepare_longs,
    split_by_query_len,
    write_kv,
)
from specfleet.kernels import cpu_native


@dataclass
class _State:
    short_seqs: torch.Tensor | None  # [n] int32 sequence indices the native kernel computes
    longs: list[LongQuery]
    write_rows: torch.Tensor | None


class NativeAttentionBackend:
    name = "native"

    def __init__(self) -> None:
        if not cpu_native.available():
            raise RuntimeError(
                "attention_backend='native' needs the native CPU kernels, which did not build "
                "(see the log); use 'torch'"
            )

    def prepare(self, meta: AttentionMetadata) -> None:
        short_ids, long_ids, starts = split_by_query_len(meta)
        short = torch.tensor(short_ids, dtype=torch.int32) if short_ids else None
        meta.backend_state = _State(short, prepare_longs(meta, long_ids, starts), padding_free_rows(meta))

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping, meta.backend_state.write_rows)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        state: _State = meta.backend_state
        out = torch.empty(query.shape, dtype=query.dtype)
        forward_longs(query, k_cache, v_cache, state.longs, scale, out)
        if state.short_seqs is not None:
            cpu_native.paged_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                state.short_seqs,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                out,
            )
        return out
