"""Persistent buffers for a step's integer inputs: the part of vLLM's persistent input batch that this engine
needs. A step's token ids, positions and KV slots are packed into one int64 buffer, its query starts,
sequence lengths and block tables into one int32 buffer; both are allocated once (grown when a step needs
more) and filled through numpy views, so a step allocates no tensor for its inputs. On the CPU the model
reads views of them; on a GPU they are pinned and reach the device in two asynchronous copies per step
(one per buffer) instead of six blocking ones.

Sets are used in a ring: a step's views (and, on a GPU, the host side of its copies) stay valid until the
ring comes round, which must not happen while it is still being read. `ModelRunner` sizes the ring to the
micro-batches a pipeline keeps in flight plus one (the step being prepared).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

# First allocation, in entries of each buffer; a step that needs more doubles it. 8192 int64 entries hold
# the 3 token rows of a 2048-token step (the default max_num_batched_tokens), and 16384 int32 entries the
# block tables of 256 sequences of 1024 tokens at block size 16, so an engine at its default limits never
# grows them.
INITIAL_TOKEN_ENTRIES = 8192
INITIAL_SEQ_ENTRIES = 16384


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, width] int32, rows padded with 0


class _Buffer:
    """One flat host buffer (pinned when the device is not the CPU), its numpy view, and its device copy."""

    def __init__(self, dtype: torch.dtype, device: torch.device, entries: int):
        self.dtype, self.device = dtype, device
        self._alloc(entries)

    def _alloc(self, entries: int) -> None:
        on_cpu = self.device.type == "cpu"
        self.host = torch.zeros(entries, dtype=self.dtype, pin_memory=not on_cpu)
        self.np = self.host.numpy()
        self.dev = self.host if on_cpu else torch.empty(entries, dtype=self.dtype, device=self.device)

    def reserve(self, entries: int) -> None:
        if self.np.shape[0] < entries:
            self._alloc(2 * entries)

    def publish(self, entries: int) -> torch.Tensor:
        """The first `entries` as the model reads them: the host buffer itself on the CPU, else its copy."""
        if self.dev is self.host:
            return self.host[:entries]
        out = self.dev[:entries]
        out.copy_(self.host[:entries], non_blocking=True)
        return out


class _Set:
    def __init__(self, device: torch.device) -> None:
        self.tokens = _Buffer(torch.int64, device, INITIAL_TOKEN_ENTRIES)
        self.seqs = _Buffer(torch.int32, device, INITIAL_SEQ_ENTRIES)


class StepBuffers:
    def __init__(self, device: torch.device, ring: int) -> None:
        if ring < 1:
            raise ValueError(f"ring={ring} must be >= 1")
        self._sets = [_Set(device) for _ in range(ring)]
        self._next = 0

    def fill(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> StepTensors:
        n, b = len(ids), len(seq_lens)
        width = max(map(len, tables), default=0)
        s = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        s.tokens.reserve(3 * n)
        s.seqs.reserve(2 * b + 1 + b * width)
        tok = s.tokens.np
        tok[:n], tok[n : 2 * n], tok[2 * n : 3 * n] = ids, positions, slots
        seq = s.seqs.np
        seq[: b + 1] = list(accumulate(query_lens, initial=0))  # numpy's cumsum costs more on short lists
        seq[b + 1 : 2 * b + 1] = seq_lens
        table = seq[2 * b + 1 : 2 * b + 1 + b * width].reshape(b, width)
        if all(len(t) == width for t in tables):
            table[:] = tables
        else:
            table.fill(0)
            for row, t in zip(table, tables):
                row[: len(t)] = t
        t64 = s.tokens.publish(3 * n)
        t32 = s.seqs.publish(2 * b + 1 + b * width)
        return StepTensors(
            t64[:n],
            t64[n : 2 * n],
            t64[2 * n :],
            t32[: b + 1],
            t32[b + 1 : 2 * b + 1],
            t32[2 * b + 1 :].view(b, width),
        )
