"""Builders for paged-attention test cases: a random cache, scattered and shared block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specfleet.engine.attention.base import AttentionMetadata

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_lens: list[int]
    seq_lens_list: list[int]
    block_size: int
    scale: float

    def slot_mapping(self) -> torch.Tensor:  # [num_tokens] int64: slots of this step's tokens
        slots = []
        for b, (q, s) in enumerate(zip(self.query_lens, self.seq_lens_list, strict=True)):
            for pos in range(s - q, s):
                block = int(self.block_tables[b, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
        return torch.tensor(slots, dtype=torch.int64)

    def metadata(self) -> AttentionMetadata:
        from specfleet.engine.attention.base import AttentionMetadata

        return AttentionMetadata(
            slot_mapping=self.slot_mapping(),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            query_lens_cpu=list(self.query_lens),
            seq_lens_cpu=list(self.seq_lens_list),
            block_size=self.block_size,
        )


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    share_prefix: bool = False,
    seed: int = 0,
) -> PagedCase:
    """Blocks are handed out in a random order with unused holes between them. With ``share_prefix``
    every sequence after the first reuses the first sequence's full leading blocks (a prefix-cache hit)
    for as much of its cached prefix as fits."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        shared = 0
        if share_prefix and b > 0:
            cached = seq_lens[b] - query_lens[b]
            shared = min(cached // block_size, (seq_lens[0] - query_lens[0]) // block_size)
            tables[b, :shared] = tables[0, :shared]
        for j in range(shared, n):
            tables[b, j] = free.pop()
            free.pop()  # leave a hole
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedCase(
        query,
        k_cache,
        v_cache,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        list(query_lens),
        list(seq_lens),
        block_size,
        head_dim**-0.5,
    )
