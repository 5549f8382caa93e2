"""cache_salt (vLLM's per-tenant prefix-cache isolation): the first block's hash includes the salt, so a
salted request's cached blocks match only requests with the same salt."""

from __future__ import annotations

import pytest
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.sampling_params import ParameterError, SamplingParams
from specfleet.engine.sequence import Sequence

BS = 4
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks and a tail: up to 2 cached blocks


def _cached(kv: BlockManager, seq_id: int, salt: str | None) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(PROMPT), len(PROMPT), SamplingParams(cache_salt=salt))
    kv.allocate(seq, len(PROMPT))
    seq.num_computed_tokens = len(PROMPT)
    kv.cache_full_blocks(seq)
    return seq


@pytest.mark.parametrize(
    ("cached_salt", "asking_salt", "hits"),
    [
        ("tenant-a", "tenant-a", 2),
        ("tenant-a", "tenant-b", 0),
        ("tenant-a", None, 0),
        (None, "tenant-a", 0),
        (None, None, 2),
    ],
)
def test_blocks_hashed_with_one_salt_match_only_that_salt(cached_salt, asking_salt, hits):
    kv = BlockManager(16, BS, debug=False)  # blocks filled by hand, not computed
    first = _cached(kv, 0, cached_salt)
    asking = Sequence(1, "r1", 0, list(PROMPT), len(PROMPT), SamplingParams(cache_salt=asking_salt))
    found = kv.lookup_prefix(asking)
    assert found == first.block_table[:hits]


def test_two_salts_cache_the_same_prompt_side_by_side():
    kv = BlockManager(16, BS, debug=False)
    a = _cached(kv, 0, "a")
    b = _cached(kv, 1, "b")
    ask = lambda salt: kv.lookup_prefix(  # noqa: E731
        Sequence(9, "x", 0, list(PROMPT), len(PROMPT), SamplingParams(cache_salt=salt))
    )
    assert ask("a") == a.block_table[:2]
    assert ask("b") == b.block_table[:2]
    assert set(a.block_table[:2]).isdisjoint(b.block_table[:2])


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ParameterError, match="cache_salt") as info:
        SamplingParams(cache_salt=salt)
    assert info.value.param == "cache_salt"


def test_the_engine_hits_the_prefix_cache_only_under_the_same_salt(tiny):
    prompt = list(range(100, 140))  # 10 blocks of 4 tokens
    greedy = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    first = tiny.generate(prompt, SamplingParams(cache_salt="tenant-a", **greedy))[0]
    other = tiny.generate(prompt, SamplingParams(cache_salt="tenant-b", **greedy))[0]
    unsalted = tiny.generate(prompt, SamplingParams(**greedy))[0]
    same = tiny.generate(prompt, SamplingParams(cache_salt="tenant-a", **greedy))[0]
    assert [first.num_cached_tokens, other.num_cached_tokens, unsalted.num_cached_tokens] == [0, 0, 0]
    assert same.num_cached_tokens == 36  # every full block but the one holding the last prompt token
    outputs = {tuple(r.outputs[0].token_ids) for r in (first, other, unsalted, same)}
    assert len(outputs) == 1, "a salt changes which blocks are reused, never the tokens"
