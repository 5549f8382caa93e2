"""Triton attention over the paged KV cache: the engine's CUDA path (``attention_backend="triton"``).

Per step, ``prepare`` picks the kernel once for all layers: when every sequence has at most
``MAX_DECODE_QUERY_LEN`` query rows (decode, speculative verification) the decode kernel, with a
context split chosen for the batch; otherwise (a prefill chunk anywhere in the batch) the prefill kernel,
which handles the decode rows of a mixed batch too. On CPU tensors the same kernels run through
Triton's interpreter (slow; for tests), so the backend behaves the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.attention.base import AttentionMetadata
from specfleet.kernels.kv_cache import reshape_and_cache
from specfleet.kernels.paged_decode import MAX_DECODE_QUERY_LEN, paged_decode_attention, pick_num_splits
from specfleet.kernels.paged_prefill import paged_prefill_attention


@dataclass(frozen=True)
class _TritonStep:
    decode: bool  # every query is short: the decode kernel, else the prefill kernel
    max_query_len: int
    max_seq_len: int
    num_splits: int  # context splits for the decode kernel; 0 until the first layer knows its heads


class TritonAttentionBackend:
    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.block_tables.dim() != 2:
            raise ValueError(
                f"block_tables must be [num_seqs, max_num_blocks], got {tuple(meta.block_tables.shape)}"
            )
        if meta.block_tables.dtype != torch.int32:
            meta.block_tables = meta.block_tables.to(torch.int32)
        for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True):
            if not 0 <= q <= s:
                raise ValueError(f"query_len={q} must be between 0 and its seq_len={s}")
        max_q = meta.max_query_len
        meta.backend_state = _TritonStep(
            decode=max_q <= MAX_DECODE_QUERY_LEN,
            max_query_len=max_q,
            max_seq_len=meta.max_seq_len,
            num_splits=0,
        )

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        step: _TritonStep = meta.backend_state
        if not isinstance(step, _TritonStep):
            raise RuntimeError("TritonAttentionBackend.forward called before prepare(meta) for this step")
        if step.max_query_len == 0:
            return torch.empty_like(query)
        if step.decode:
            if step.num_splits == 0:
                num_splits = pick_num_splits(meta.num_seqs, k_cache.shape[2], step.max_seq_len, query.device)
                step = meta.backend_state = _TritonStep(
                    True, step.max_query_len, step.max_seq_len, num_splits
                )
            return paged_decode_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                step.max_query_len,
                step.max_seq_len,
                num_splits=step.num_splits,
            )
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            step.max_query_len,
        )
