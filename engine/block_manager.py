"""KV cache blocks: O(1) allocate and free, reference counts, prefix caching with LRU eviction.

A full block of verified tokens is registered under a chained hash (its parent's hash and its tokens;
the first block also the request's `cache_salt`, as vLLM's extra keys), so a later prompt with the same
prefix, and the same salt, reuses it; a salted block never matches another salt's or an unsalted one. Freed blocks stay in the hash table until they are
evicted: the free pool is an ordered dict where blocks that hold nothing reusable go to the front and
cached blocks to the back, so eviction takes the least recently freed cached block last.
"""

from __future__ import annotations

import os
from collections import OrderedDict

from specfleet.engine.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, salt_digest
from specfleet.engine.sequence import Sequence

# SPECFLEET_KV_DEBUG=1 records, for every slot, which token prefix its K/V was computed from, and checks
# that a block registered in the prefix cache holds exactly the prefix its hash names (tests turn it on).
KV_DEBUG = os.environ.get("SPECFLEET_KV_DEBUG", "") not in ("", "0")


# A cached block's key: (parent block's hash or None, the block's tokens, cache_salt on the first block;
# with a LoRA adapter, (cache_salt, the adapter's (name, digest)) there instead)
BlockKey = tuple[int | None, tuple[int, ...], object]


class NoFreeBlocksError(RuntimeError):
    pass


class KVContentError(AssertionError):
    """Debug mode: a block's K/V was computed from other tokens than the ones it is used or cached for."""


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, debug: bool = KV_DEBUG
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Each cached block's whole key (parent hash, tokens, salt): guards against hash collisions
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # The chained hashes of each sequence's leading full blocks, as far as they were cached.
        self._hashes: dict[int, list[int]] = {}
        self.debug = debug
        self._slot_prefix: dict[int, int] = {}  # debug: slot -> hash of the token prefix its K/V encodes
        # KV events (engine/kv_events.py) since the last `take_events`; None: not recorded (the default)
        self.events: list[BlockStored | BlockRemoved] | None = None

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

    def _key(self, seq: Sequence, index: int, parent: int | None) -> BlockKey:
        """Block `index`'s key: its parent's hash and its tokens; the first block also carries the
        request's cache_salt, which the chain passes on to every later block."""
        bs = self.block_size
        salt: object = seq.params.cache_salt if index == 0 else None
        if index == 0 and seq.lora is not None:  # an adapter's K/V differ from the base's and other adapters'
            salt = (salt, seq.lora.cache_key)
        return parent, tuple(seq.token_ids[index * bs : (index + 1) * bs]), salt

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks; the last token is never cached
        (its logits are needed), so at most (num_tokens - 1) // block_size blocks."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = self._key(seq, i, parent)
            h = hash(key)
            block = self.hash_to_block.get(h)
            if block is None or self.block_key[block] != key:
                break
            hits.append(block)
            parent = h
        return hits

    def num_new_blocks(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> int:
        """Free blocks needed so that `seq` has slots for `num_tokens` tokens (hits taken first)."""
        have = len(seq.block_table) or len(hits)
        from_free_pool = sum(1 for b in hits if self.ref_counts[b] == 0) if not seq.block_table else 0
        return max(0, self.blocks_for(num_tokens) - have) + from_free_pool

    # -- check, then act -----------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> bool:
        return self.num_new_blocks(seq, num_tokens, hits) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> None:
        """Give `seq` slots for `num_tokens` tokens, first adopting prefix-cache `hits` (only for a
        sequence with no blocks yet). All or nothing."""
        if not self.can_allocate(seq, num_tokens, hits):
            raise NoFreeBlocksError(
                f"need {self.num_new_blocks(seq, num_tokens, hits)} blocks, {len(self.free)} free"
            )
        if not seq.block_table and hits:
            for b in hits:
                self._ref(b)
            seq.block_table = list(hits)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())

    def shared_prefix(self, parent: Sequence, child: Sequence) -> list[int]:
        """For n > 1: the parent's full, computed prompt blocks, which a sibling sample can adopt. Only
        prompt blocks: past the prompt the parent's blocks hold its own samples, not the child's."""
        bs = self.block_size
        n = min(
            len(parent.block_table),
            (child.num_tokens - 1) // bs,
            parent.num_computed_tokens // bs,
            child.num_prompt_tokens // bs,
        )
        return parent.block_table[:n]

    def note_computed(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        """Debug mode: `tokens` (positions start.. of `seq`) are about to be computed into its slots; check
        that the slots before `start`, which attention reads, hold its own prefix, then record the new ones."""
        if not self.debug:
            return
        chain = _prefix_chain(seq.token_ids[:start] + list(tokens))
        for pos in range(start):
            if self._slot_prefix.get(self._slot(seq, pos)) != chain[pos]:
                raise KVContentError(
                    f"sequence {seq.seq_id} reads position {pos} from block "
                    f"{seq.block_table[pos // self.block_size]}, computed for other tokens"
                )
        for pos in range(start, start + len(tokens)):
            self._slot_prefix[self._slot(seq, pos)] = chain[pos]

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks of verified, computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * bs) // bs
        hashes = self._hashes.setdefault(seq.seq_id, [])
        stored: list[int] = []  # indexes of the blocks registered now, for the KV events
        for i in range(len(hashes), full):
            block = seq.block_table[i]
            key = self._key(seq, i, hashes[-1] if hashes else None)
            h = hash(key)
            hashes.append(h)
            if self.debug:
                self._check_block(seq, i)
            # A block already registered elsewhere under the same content stays private.
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block], self.block_key[block] = h, key
                self.hash_to_block[h] = block
                stored.append(i)
        if self.events is not None and stored:
            self._record_stored(seq, hashes, stored)

    def _record_stored(self, seq: Sequence, hashes: list[int], stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks registered together (vLLM batches them so)."""
        assert self.events is not None
        bs, salt = self.block_size, seq.params.cache_salt
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first = run[0]
            extra = None
            if first == 0 and isinstance(salt, str) and salt:
                extra = [["cache_salt", salt_digest(salt)]] + [None] * (len(run) - 1)
            self.events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in run],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=list(seq.token_ids[first * bs : (run[-1] + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=seq.lora.name if seq.lora is not None else None,
                    extra_keys=extra,
                )
            )

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The KV events recorded since the last call (empty when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _check_block(self, seq: Sequence, index: int) -> None:
        bs = self.block_size
        chain = _prefix_chain(seq.token_ids[: (index + 1) * bs])
        if any(
            self._slot_prefix.get(self._slot(seq, pos)) != chain[pos]
            for pos in range(index * bs, (index + 1) * bs)
        ):
            raise KVContentError(
                f"block {seq.block_table[index]} would be cached for sequence {seq.seq_id}'s "
                f"tokens {index * bs}..{(index + 1) * bs - 1}, but holds K/V of other tokens"
            )

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

    def hold(self, blocks: list[int]) -> None:
        """An extra reference on each block (a KV connector keeping a finished prompt's blocks)."""
        for b in blocks:
            self._ref(b)

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._unref(b)

    # -- blocks ------------------------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict: its content is about to be overwritten
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                if self.events is not None:
                    self.events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU))
            self.block_hash[block] = self.block_key[block] = None
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


def _prefix_chain(tokens: list[int]) -> list[int]:
    """Debug mode: one hash per position naming the whole prefix up to it (a token's K/V depends on all)."""
    chain, h = [], 0
    for token in tokens:
        h = hash((h, token))
        chain.append(h)
    return chain
