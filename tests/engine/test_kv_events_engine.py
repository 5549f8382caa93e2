"""A real engine publishes its KV events while it serves; the router's subscriber, started after the
first requests (its gap filled by replay), ends with an index equal to the engine's prefix cache, through
evictions of a small KV cache."""

from __future__ import annotations

import json
import time

from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.sequence import Sequence
from specfleet.router.kv_index import ExactPrefixIndex
from specfleet.router.kv_subscriber import KVEventSubscriber
from specfleet.router.prefix import chain_hashes, stable_hash, token_blocks

BS = 4  # tests/engine/conftest.py's TINY_LLM_KWARGS
URL = "http://tiny"
SEED = stable_hash("tiny")
# 32 blocks of 4 tokens: 12 requests of 13-token prompts and 8 new tokens (5 cached blocks each) need
# 60, so the cache evicts about half of what it stored.
NUM_KV_BLOCKS = 32
EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
}


def _prompt(i: int) -> list[int]:
    return [200 + 40 * i + t for t in range(13)]  # distinct: no two prompts share a block


def _cached(engine, tokens: list[int]) -> list[int]:
    """The router-scheme hashes of the blocks of `tokens` the engine's prefix cache holds."""
    probe = Sequence(10**9, "probe", 0, list(tokens), len(tokens), SamplingParams())
    n = len(engine.kv.lookup_prefix(probe))
    return chain_hashes(token_blocks(tokens, BS), SEED)[:n]


def test_the_index_equals_the_engines_cache_through_evictions(make_tiny) -> None:
    llm = make_tiny(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=64, kv_events_config=json.dumps(EVENTS))
    engine, publisher = llm.engine, llm.engine.kv_events
    assert publisher is not None
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": _prompt(i)} for i in range(3)], params)
    index = ExactPrefixIndex(SEED)
    sub = KVEventSubscriber(index)
    try:
        sub.add(URL, publisher.endpoint, publisher.replay_endpoint)
        time.sleep(1.0)  # the SUB connection (slow joiner); the batches before it come back by replay
        outputs += llm.generate([{"prompt_token_ids": _prompt(i)} for i in range(3, 12)], params)
        sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
        expected: set[int] = set()
        for tokens in sequences:
            expected |= set(_cached(engine, tokens))
        assert sum(len(_cached(engine, t)) for t in sequences) == len(engine.kv.hash_to_block)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with sub.lock:
                held = index.hashes(URL)
            if held == expected:
                break
            time.sleep(0.1)
        assert held == expected, (len(held), len(expected), sub.feeds[URL])
        feed = sub.feeds[URL]
        assert feed.replayed >= 1 and feed.lost == 0, feed  # the first requests' batches, by replay
        assert index.removed > 0  # the small cache evicted, and those blocks left the index
        # the router's hashes of a prompt match exactly what the engine would reuse of it
        last = sequences[-1]
        assert sub.match(URL, chain_hashes(token_blocks(last, BS), SEED)) == len(_cached(engine, last))
    finally:
        sub.close()
        llm.engine.close()
