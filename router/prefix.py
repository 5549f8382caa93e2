"""Prompt blocks and the router's estimate of which engine's prefix cache holds them. Plain Python.

The engine's prefix cache registers each full block of `block_size` tokens under a chained hash (the
parent block's hash and the block's tokens, engine/block_manager.py); a later prompt reuses the longest
run of leading blocks it finds, and a request's `cache_salt` salts its first block, so salted blocks serve
only the same salt. The router hashes a prompt the same way, into the same chained blocks, salt included,
and keeps per engine an LRU set of the block hashes it sent there (an approximate index, as GIE's and
KubeAI's routers do: no feedback from the engine, so evictions there are not seen here; the LRU's size
should match the engine's KV blocks).

Without a tokenizer (the cluster router by default) a block is `block_size * CHARS_PER_TOKEN` characters
of the prompt text: the same prefix property (same leading text -> same leading blocks), at the cost of
block edges that do not fall on the engine's token edges.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Characters per token for the character fallback: English BPE vocabularies average ~4 (GIE's
# approximate prefix scorer uses 64-character blocks for 16-token engine blocks on the same ratio).
CHARS_PER_TOKEN = 4
# Blocks hashed per prompt at most: 256 blocks of 16 tokens = 4,096 tokens, past which a longer match
# changes no decision on the workloads measured (GIE truncates at 256 blocks too).
MAX_BLOCKS = 256


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def chain_hashes(blocks: Sequence[tuple[int, ...] | str], seed: int = 0) -> list[int]:
    """Chained hashes: block i's hash covers block i and, through its parent, every block before it.
    Tuples of ints hash the same in every process; text blocks go through `stable_hash` first."""
    out: list[int] = []
    parent = seed
    for block in blocks:
        parent = hash((parent, stable_hash(block) if isinstance(block, str) else block))
        out.append(parent)
    return out


def token_blocks(
    token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS
) -> list[tuple[int, ...]]:
    """The full blocks of a token list, as the engine's prefix cache cuts them (a partial tail is not cached)."""
    full = min(len(token_ids) // block_size, max_blocks)
    return [tuple(token_ids[i * block_size : (i + 1) * block_size]) for i in range(full)]


def char_blocks(text: str, block_chars: int, max_blocks: int = MAX_BLOCKS) -> list[str]:
    full = min(len(text) // block_chars, max_blocks)
    return [text[i * block_chars : (i + 1) * block_chars] for i in range(full)]


@dataclass(frozen=True)
class BlockHasher:
    """Prompt text -> chained block hashes. `encode` is a tokenizer's text -> ids, or None for characters."""

    block_size: int = 16  # tokens per block: the engine's `block_size` (EngineConfig default 16)
    encode: Callable[[str], list[int]] | None = None
    seed: int = 0  # e.g. a hash of the model name, so two models never share blocks

    @property
    def unit(self) -> str:
        return "tokens" if self.encode is not None else "chars"

    def salted_seed(self, cache_salt: object = None, adapter: str | None = None) -> int:
        """The chain's seed for a request: with a `cache_salt` (a non-empty string, as the engine takes it)
        the salt goes into the first block's hash, as in the engine, so two tenants' prompts never count
        as each other's cached prefix; anything else is the engine's 400 and changes nothing here. A LoRA
        adapter's name goes in too: its blocks never match the base's or another adapter's."""
        seed = self.seed
        if isinstance(cache_salt, str) and cache_salt:
            seed = hash((seed, stable_hash(cache_salt)))
        return seed if adapter is None else hash((seed, stable_hash(f"lora:{adapter}")))

    def hashes(self, text: str, cache_salt: object = None, adapter: str | None = None) -> list[int]:
        seed = self.salted_seed(cache_salt, adapter)
        if self.encode is not None:
            return chain_hashes(token_blocks(self.encode(text), self.block_size), seed)
        return chain_hashes(char_blocks(text, self.block_size * CHARS_PER_TOKEN), seed)


class PrefixIndex:
    """Per engine, an LRU set of the block hashes routed there; `match` = leading blocks it holds."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"prefix index capacity_blocks={capacity_blocks} must be >= 1")
        self.capacity = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, url: str, hashes: Sequence[int]) -> int:
        lru = self._lru.get(url)
        if not lru:
            return 0
        n = 0
        for h in hashes:  # chained: block i can only be reused if every block before it is
            if h not in lru:
                break
            n += 1
        return n

    def insert(self, url: str, hashes: Sequence[int]) -> None:
        lru = self._lru.setdefault(url, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def forget(self, url: str) -> None:
        """An engine left (or restarted with an empty cache): nothing of its index holds any more."""
        self._lru.pop(url, None)

    def size(self, url: str) -> int:
        return len(self._lru.get(url, ()))
