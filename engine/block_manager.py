"""KV cache blocks: O(1) allocate and free, reference counts, prefix caching with LRU eviction.

A full block of verified tokens is registered under a chained hash (its parent's hash and its tokens),
so a later prompt with the same prefix reuses it. Freed blocks stay in the hash table until they are
evicted: the free pool is an ordered dict where blocks that hold nothing reusable go to the front and
cached blocks to the back, so eviction takes the least recently freed cached block last.
"""

from __future__ import annotations

from collections import OrderedDict

from specfleet.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # guards against collisions
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # The chained hashes of each sequence's leading full blocks, as far as they were cached.
        self._hashes: dict[int, list[int]] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks; the last token is never cached
        (its logits are needed), so at most (num_tokens - 1) // block_size blocks."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._chain(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            parent = h
        return hits

    def num_new_blocks(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> int:
        """Free blocks needed so that `seq` has slots for `num_tokens` tokens (hits taken first)."""
        have = len(seq.block_table) or len(hits)
        from_free_pool = sum(1 for b in hits if self.ref_counts[b] == 0) if not seq.block_table else 0
        return max(0, self.blocks_for(num_tokens) - have) + from_free_pool

    # -- check, then act -----------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        return self.num_new_blocks(seq, num_tokens, hits) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """Give `seq` slots for `num_tokens` tokens, first adopting prefix-cache `hits` (only for a
        sequence with no blocks yet). All or nothing."""
        if not self.can_allocate(seq, num_tokens, hits):
            raise NoFreeBlocksError(f"need {self.num_new_blocks(seq, num_tokens, hits)} blocks, {len(self.free)} free")
        if not seq.block_table and hits:
            for b in hits:
                self._ref(b)
            seq.block_table = list(hits)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())

    def shared_prefix(self, parent: Sequence, child: Sequence) -> list[int]:
        """For n > 1: the parent's full, computed prompt blocks, which a sibling sample can adopt."""
        n = min(len(parent.block_table), (child.num_tokens - 1) // self.block_size,
                parent.num_computed_tokens // self.block_size)
        return parent.block_table[:n]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks of verified, computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * bs) // bs
        hashes = self._hashes.setdefault(seq.seq_id, [])
        for i in range(len(hashes), full):
            block = seq.block_table[i]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._chain(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            # A block already registered elsewhere under the same content stays private.
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block], self.block_tokens[block] = h, tokens
                self.hash_to_block[h] = block

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks beyond what `num_tokens` tokens need (rejected speculative tokens)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())
        del self._hashes.setdefault(seq.seq_id, [])[keep:]

    def free_seq(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table = []
        self._hashes.pop(seq.seq_id, None)

    # -- blocks ------------------------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict: its content is about to be overwritten
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] < 0:
            raise RuntimeError(f"block {block} freed more often than referenced")
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_hash[block] is None:
                self.free.move_to_end(block, last=False)
