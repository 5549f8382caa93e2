"""KV cache blocks: O(1) allocate and free, reference counts, prefix caching with LRU eviction.

A full block of verified tokens is registered under a chained hash (its parent's hash and its tokens;
the first block also the request's `cache_salt`, as vLLM's extra keys), so a later prompt with the same
prefix, and the same salt, reuses it; a salted block never matches another salt's or an unsalted one. Freed blocks stay in the hash table until they are
evicted: the free pool is an ordered dict where blocks that hold nothing reusable go to the front and
cached blocks to the back, so eviction takes the least recently freed cached block last.

Sliding-window layers (Gemma 2/3) can keep only their window (vLLM's hybrid KV cache manager, with two
layer groups): `sliding_window` gives them a second pool and each sequence a second table,
`seq.sliding_table`, indexed like `seq.block_table`. After each step a sequence lets go of the sliding
blocks whose tokens are all older than the window its next query sees (positions before
`num_computed_tokens - window + 1`) and keeps NULL_BLOCK in their entries, so its sliding blocks stay
within the window plus one block between steps (plus the step's new tokens during one). The full layers
keep `block_table` as before. Prefix caching registers a block in both pools under the same chained hash;
a hit of n blocks needs the full pool to hold all n and the sliding pool the ones inside the window before
position n * block_size (`lookup_prefix` shortens the hit until it does), so a hit is exact for both groups.
A sliding sequence frees and adopts its blocks by the same rules for preemption, trimming of rejected
proposals and the prompt blocks of n > 1 samples.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from specfleet.engine.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, salt_digest
from specfleet.engine.sequence import Sequence

# SPECFLEET_KV_DEBUG=1 records, for every slot, which token prefix its K/V was computed from, and checks
# that a block registered in the prefix cache holds exactly the prefix its hash names (tests turn it on).
KV_DEBUG = os.environ.get("SPECFLEET_KV_DEBUG", "") not in ("", "0")


# A cached block's key: (parent block's hash or None, the block's tokens, cache_salt on the first block;
# with a LoRA adapter, (cache_salt, the adapter's (name, digest)) there instead)
BlockKey = tuple[int | None, tuple[int, ...], object]


# A sliding table's entry for a block that fell out of the window: the sliding pool's block 0, never handed
# out, so a table stays a list of valid block ids (attention never reads a position outside its window).
NULL_BLOCK = 0


@dataclass
class SlidingLayers:
    """A model's sliding-window layers when they keep only their window: which layers, their window, and the
    blocks of their pool, the null block included (engine/loader.py kv_cache_blocks sets it)."""

    layers: frozenset[int]
    window: int
    num_blocks: int = 0


class NoFreeBlocksError(RuntimeError):
    pass


class PrefixHits(list[int]):
    """Prefix-cache hits: the full-attention blocks (the list itself) and, with a sliding-window group, the
    sliding table the sequence starts with (`sliding`: NULL_BLOCK before the window, then the hit blocks)."""

    sliding: list[int]

    def __init__(self, blocks: list[int], sliding: list[int]):
        super().__init__(blocks)
        self.sliding = sliding


class KVContentError(AssertionError):
    """Debug mode: a block's K/V was computed from other tokens than the ones it is used or cached for."""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        debug: bool = KV_DEBUG,
        sliding_window: int | None = None,
        num_sliding_blocks: int = 0,
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
        # The sliding-window layers' pool (None: every layer keeps the whole sequence in `block_table`); its
        # block 0 is NULL_BLOCK, held for ever. It records no KV events: the full blocks name the prefix.
        self.window = sliding_window
        self.sliding: BlockManager | None = None
        if sliding_window is not None:
            if sliding_window < 1 or num_sliding_blocks < 2:
                raise ValueError(
                    f"sliding_window={sliding_window} must be >= 1 and num_sliding_blocks={num_sliding_blocks} "
                    ">= 2 (one is the null block)"
                )
            self.sliding = BlockManager(num_sliding_blocks, block_size, enable_prefix_caching, debug)
            self.sliding._ref(NULL_BLOCK)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_used_sliding_blocks(self) -> int:
        """Sliding-window blocks held by sequences (0 without a sliding group; the null block not counted)."""
        return 0 if self.sliding is None else self.sliding.num_used_blocks - 1

    def usage(self) -> float:
        """The fuller pool's share in use (the one that preempts first)."""
        used = self.num_used_blocks / self.num_blocks
        if self.sliding is not None:
            used = max(used, self.num_used_sliding_blocks / (self.sliding.num_blocks - 1))
        return used

    def first_in_window(self, position: int) -> int:
        """The first block a sliding layer's query at `position` reads (those before it hold only older keys)."""
        assert self.window is not None
        return max(0, (position - self.window + 1) // self.block_size)

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
        hits, parent, keys = [], None, []
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = self._key(seq, i, parent)
            h = hash(key)
            block = self.hash_to_block.get(h)
            if block is None or self.block_key[block] != key:
                break
            hits.append(block)
            keys.append((h, key))
            parent = h
        if self.sliding is None:
            return hits
        return self._window_hits(hits, keys)

    def _window_hits(self, hits: list[int], keys: list[tuple[int, BlockKey]]) -> PrefixHits:
        """The longest of the full pool's `hits` whose window the sliding pool holds too, with that table."""
        assert self.sliding is not None
        pool, found, runs, run = self.sliding, [], [], 0
        for h, key in keys:
            block = pool.hash_to_block.get(h)
            ok = block is not None and pool.block_key[block] == key
            found.append(block if ok and block is not None else NULL_BLOCK)
            run = run + 1 if ok else 0
            runs.append(run)  # cached sliding blocks in a row, ending at this one
        n = len(hits)
        while n and runs[n - 1] < n - self.first_in_window(n * self.block_size):
            n -= 1
        first = self.first_in_window(n * self.block_size)
        return PrefixHits(hits[:n], [NULL_BLOCK] * first + found[first:n])

    def num_new_blocks(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> int:
        """Free blocks needed so that `seq` has slots for `num_tokens` tokens (hits taken first)."""
        have = len(seq.block_table) or len(hits)
        from_free_pool = sum(1 for b in hits if self.ref_counts[b] == 0) if not seq.block_table else 0
        return max(0, self.blocks_for(num_tokens) - have) + from_free_pool

    def num_new_sliding_blocks(
        self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()
    ) -> int:
        """As num_new_blocks, for the sliding pool (entries before the window cost nothing)."""
        assert self.sliding is not None
        if seq.sliding_table:
            return max(0, self.blocks_for(num_tokens) - len(seq.sliding_table))
        table = self._sliding_hits(hits)
        pool = self.sliding
        from_free_pool = sum(1 for b in table if b != NULL_BLOCK and pool.ref_counts[b] == 0)
        return max(0, self.blocks_for(num_tokens) - len(table)) + from_free_pool

    @staticmethod
    def _sliding_hits(hits: list[int] | tuple[int, ...]) -> list[int]:
        if not hits:
            return []
        if not isinstance(hits, PrefixHits):
            raise TypeError(
                "prefix hits of a sliding-window cache must come from lookup_prefix or shared_prefix, "
                "which also name the sliding blocks"
            )
        return hits.sliding

    # -- check, then act -----------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> bool:
        if self.sliding is not None and self.num_new_sliding_blocks(seq, num_tokens, hits) > len(
            self.sliding.free
        ):
            return False
        return self.num_new_blocks(seq, num_tokens, hits) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> None:
        """Give `seq` slots for `num_tokens` tokens, first adopting prefix-cache `hits` (only for a
        sequence with no blocks yet). All or nothing."""
        if not self.can_allocate(seq, num_tokens, hits):
            raise NoFreeBlocksError(
                f"need {self.num_new_blocks(seq, num_tokens, hits)} blocks, {len(self.free)} free"
                + (
                    f"; {self.num_new_sliding_blocks(seq, num_tokens, hits)} sliding-window blocks, "
                    f"{len(self.sliding.free)} free"
                    if self.sliding is not None
                    else ""
                )
            )
        if self.sliding is not None:
            self._allocate_sliding(seq, num_tokens, hits)
        if not seq.block_table and hits:
            for b in hits:
                self._ref(b)
            seq.block_table = list(hits)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())

    def _allocate_sliding(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...]) -> None:
        pool = self.sliding
        assert pool is not None
        if not seq.sliding_table and hits:
            table = self._sliding_hits(hits)
            for b in table:
                if b != NULL_BLOCK:
                    pool._ref(b)
            seq.sliding_table = list(table)
        while len(seq.sliding_table) < self.blocks_for(num_tokens):
            seq.sliding_table.append(pool._take_free())

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
        if self.sliding is None:
            return parent.block_table[:n]
        # The parent may have let go of the sliding blocks before its window: share no further than the
        # prefix whose window it still holds.
        while n and NULL_BLOCK in parent.sliding_table[self.first_in_window(n * bs) : n]:
            n -= 1
        first = self.first_in_window(n * bs)
        return PrefixHits(parent.block_table[:n], [NULL_BLOCK] * first + parent.sliding_table[first:n])

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
        if self.sliding is None:
            return
        # the sliding layers read the window before `start` from their own pool
        seen = self.sliding._slot_prefix
        for pos in range(max(0, start - self.window + 1) if self.window else 0, start):
            if seen.get(self._slot(seq, pos, seq.sliding_table)) != chain[pos]:
                raise KVContentError(
                    f"sequence {seq.seq_id} reads position {pos} from sliding-window block "
                    f"{seq.sliding_table[pos // self.block_size]}, computed for other tokens"
                )
        for pos in range(start, start + len(tokens)):
            seen[self._slot(seq, pos, seq.sliding_table)] = chain[pos]

    def _slot(self, seq: Sequence, pos: int, table: list[int] | None = None) -> int:
        table = seq.block_table if table is None else table
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks of verified, computed tokens in the prefix cache; with a
        sliding group, then let go of the sliding blocks its next query no longer reads (after every step)."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)
        if self.sliding is not None:
            self._release_outside_window(seq)

    def _release_outside_window(self, seq: Sequence) -> None:
        """NULL_BLOCK for each sliding block whose tokens all precede the window of position
        num_computed_tokens (the first the next step computes); the entries before the window are NULL
        already, so the scan stops at the first one."""
        assert self.sliding is not None
        table = seq.sliding_table
        end = min(self.first_in_window(seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] != NULL_BLOCK:
            start -= 1
        for i in range(start, end):  # oldest first: evicted first among the cached ones freed here
            self.sliding._unref(table[i])
            table[i] = NULL_BLOCK

    def _register_full_blocks(self, seq: Sequence) -> None:
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
            if self.sliding is not None:
                self.sliding._register(seq.sliding_table[i], h, key)
        if self.events is not None and stored:
            self._record_stored(seq, hashes, stored)

    def _register(self, block: int, h: int, key: BlockKey) -> None:
        """The sliding pool: cache `block` under `h`, unless it is the null block or the hash is taken."""
        if block != NULL_BLOCK and self.block_hash[block] is None and h not in self.hash_to_block:
            self.block_hash[block], self.block_key[block] = h, key
            self.hash_to_block[h] = block

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
        if self.sliding is not None and seq.sliding_table[index] != NULL_BLOCK:
            seen = self.sliding._slot_prefix
            if any(
                seen.get(self._slot(seq, pos, seq.sliding_table)) != chain[pos]
                for pos in range(index * bs, (index + 1) * bs)
            ):
                raise KVContentError(
                    f"sliding-window block {seq.sliding_table[index]} would be cached for sequence "
                    f"{seq.seq_id}'s tokens {index * bs}..{(index + 1) * bs - 1}, but holds K/V of other tokens"
                )

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks beyond what `num_tokens` tokens need (rejected speculative tokens)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())
        del self._hashes.setdefault(seq.seq_id, [])[keep:]
        if self.sliding is not None:
            while len(seq.sliding_table) > keep:
                if (b := seq.sliding_table.pop()) != NULL_BLOCK:
                    self.sliding._unref(b)

    def free_seq(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table = []
        self._hashes.pop(seq.seq_id, None)
        if self.sliding is not None:
            for b in reversed(seq.sliding_table):
                if b != NULL_BLOCK:
                    self.sliding._unref(b)
            seq.sliding_table = []

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
