"""The attention-backend interface: what the model needs from attention over the paged KV cache.

KV cache layout, per layer, shared by every backend:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
A token's slot is ``block_id * block_size + offset``; slot -1 means "do not write" (padding).

One step's tokens are flattened: sequence b owns query rows
``query_start_loc[b] : query_start_loc[b + 1]``. Those rows are the last ``query_len`` tokens of its
context of ``seq_lens[b]`` tokens (this step's tokens included), and attend causally: query row i of
sequence b sits at position ``seq_lens[b] - query_len[b] + i`` and sees keys ``0 ..= that position``.
Decode (1 row), speculative verification (k + 1 rows) and chunked prefill (a chunk after a cached
prefix) are all this one case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    query_lens_cpu: list[int]  # [num_seqs]
    seq_lens_cpu: list[int]  # [num_seqs]
    block_size: int
    # What a backend precomputes once per step in `prepare` and reuses in every layer.
    backend_state: Any = field(default=None)
    # The step's LoRA rows and adapters (engine/lora LoraBatch) that the model's projections add; None when
    # no scheduled sequence has an adapter (the model then runs as the base, fused decode path included).
    lora: Any = field(default=None)
    # The sliding-window layers' own slots and block tables when they keep only their window (a pool of
    # their own, engine/block_manager.py); None: every layer reads these.
    sliding: AttentionMetadata | None = field(default=None)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step state (index tensors, masks) into ``meta.backend_state``."""

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
