"""The exact prefix index: per engine, the blocks its prefix cache holds, kept from the engine's KV events
(engine/kv_events.py, vLLM's format) rather than estimated from what the router sent it. Plain Python.

Events carry the engine's own block hashes (process-local: Python's hash of the engine's keys) and each
block's token ids, so the index re-hashes every stored block in the router's scheme (router/prefix.py:
`hash((parent, tokens))` from the model's seed, salted as `BlockHasher.salted_seed`), the way llm-d's
indexer does, and keeps the engine hash -> router hash map that resolves a later BlockRemoved. A store whose
parent the index never saw (it joined mid-stream, or a batch was lost for good) is skipped: the blocks after
it cannot be placed in the chain, and a prefix the index misses costs only a normal prefill. Blocks of a
LoRA adapter are keyed by the adapter on the engine and not by the router's hasher, so they are skipped.
`AllBlocksCleared` empties the engine's index (vLLM sends it when the engine's prefix cache is reset).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

SALT_KEY = "cache_salt"  # extra_keys entry of a salted chain's first block: ["cache_salt", digest]


class ExactPrefixIndex:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed  # BlockHasher.seed of the model (stable_hash of its source)
        self._to_router: dict[str, dict[int, int]] = {}  # engine -> engine block hash -> router hash
        self._blocks: dict[str, dict[int, int]] = {}  # engine -> router hash -> engine blocks holding it
        self.skipped = 0  # stored blocks whose parent was unknown, or of a LoRA adapter
        self.removed = 0  # blocks removed from the index (the engines evicted them)

    def tracks(self, url: str) -> bool:
        """Whether events from this engine arrived (else the router falls back to its estimate)."""
        return url in self._blocks

    def start(self, url: str) -> None:
        self._to_router.setdefault(url, {})
        self._blocks.setdefault(url, {})

    def forget(self, url: str) -> None:
        self._to_router.pop(url, None)
        self._blocks.pop(url, None)

    def match(self, url: str, hashes: Sequence[int]) -> int:
        blocks = self._blocks.get(url)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def hashes(self, url: str) -> set[int]:
        return set(self._blocks.get(url, ()))

    def apply(self, url: str, events: Iterable[Any]) -> None:
        """One KVEventBatch's events, in order."""
        self.start(url)
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(url, event)
            elif kind == "BlockRemoved":
                self._removed(url, event.block_hashes)
            elif kind == "AllBlocksCleared":
                self._to_router[url].clear()
                self._blocks[url].clear()
            else:
                raise ValueError(f"unknown KV event {kind!r}")

    def _stored(self, url: str, event: Any) -> None:
        to_router, blocks = self._to_router[url], self._blocks[url]
        if event.lora_name is not None:
            self.skipped += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            parent = self.seed
            first = (event.extra_keys or [None])[0]
            if first and first[0] == SALT_KEY:
                parent = hash((self.seed, int(first[1])))
        elif event.parent_block_hash in to_router:
            parent = to_router[event.parent_block_hash]
        else:
            self.skipped += len(event.block_hashes)
            return
        bs, tokens = event.block_size, event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if engine_hash in to_router:  # stored again without a removal in between (a replayed batch)
                continue
            to_router[engine_hash] = parent
            blocks[parent] = blocks.get(parent, 0) + 1

    def _removed(self, url: str, engine_hashes: Iterable[int]) -> None:
        to_router, blocks = self._to_router[url], self._blocks[url]
        for engine_hash in engine_hashes:
            router_hash = to_router.pop(engine_hash, None)
            if router_hash is None:
                continue
            self.removed += 1
            left = blocks.get(router_hash, 0) - 1
            if left > 0:
                blocks[router_hash] = left
            else:
                blocks.pop(router_hash, None)
