"""The engine under KV-cache pressure: a cache too small for one context is refused at start, a sequence
that cannot grow ends instead of livelocking, random mixes always make progress, and n > 1 samples never
read their sibling's K/V (the prefix cache is checked against what its blocks were computed from)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.block_manager import BlockManager, KVContentError
from specfleet.engine.config import EngineConfig
from specfleet.engine.loader import kv_cache_blocks
from specfleet.engine.scheduler import Scheduler
from specfleet.engine.sequence import Sequence

BS = 4


# -- the cache must hold one sequence of max_model_len ------------------------------------------------
@pytest.mark.slow
def test_a_cache_smaller_than_one_context_is_refused_at_start(tiny_llama):
    with pytest.raises(ValueError) as err:
        LLM(model=tiny_llama, block_size=4, num_kv_blocks=4, max_model_len=256)
    message = str(err.value)
    assert "max_model_len=256" in message and "num_kv_blocks=4" in message and "--max-model-len 16" in message


@pytest.mark.slow
def test_a_context_that_fills_the_cache_runs_to_length_and_the_next_request_follows(tiny_llama):
    llm = LLM(model=tiny_llama, block_size=4, num_kv_blocks=16, max_model_len=64, max_num_seqs=4)
    long, short = llm.generate(
        [[5, 6, 7, 8, 9], [10, 11, 12]],
        [
            SamplingParams(max_tokens=None, ignore_eos=True, temperature=0),
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
        ],
    )
    assert long.outputs[0].finish_reason == "length" and len(long.outputs[0].token_ids) == 64 - 5
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 4
    assert llm.engine.kv_blocks_in_use() == 0


def _model(layers: int, kv_heads: int, head_dim: int, element_size: int):
    args = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    return SimpleNamespace(args=args, dtype={4: torch.float32, 2: torch.bfloat16}[element_size])


def test_cuda_budget_covers_target_and_draft_caches_from_one_fraction():
    target, draft = _model(30, 3, 64, 2), _model(30, 3, 64, 2)  # 2*30*16*3*64*2 = 368,640 bytes a block
    config = EngineConfig(kv_cache_memory_fraction=0.5, max_model_len=4096)
    info = lambda device: (60 * 2**30, 100 * 2**30)  # noqa: E731 - 60 GiB free of 100: 10 GiB for KV
    cuda = torch.device("cuda")
    alone = kv_cache_blocks(config, [target], 4096, cuda, mem_get_info=info)
    both = kv_cache_blocks(config, [target, draft], 4096, cuda, mem_get_info=info)
    assert alone == 10 * 2**30 // 368_640
    assert both == 10 * 2**30 // (2 * 368_640)  # the draft's cache no longer comes on top of the fraction
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=0.5"):
        kv_cache_blocks(config, [target], 4096, cuda, mem_get_info=lambda d: (50 * 2**30, 100 * 2**30))


# -- the scheduler never livelocks -----------------------------------------------------------------------
def _seq(i: int, prompt: list[int], params: SamplingParams, parent: Sequence | None = None) -> Sequence:
    seq = Sequence(i, f"r{i}", 0 if parent is None else parent.index + 1, list(prompt), len(prompt), params)
    seq.parent = parent
    return seq


def _step(sched: Scheduler, rng: random.Random, spec: int, max_model_len: int) -> tuple[int, int]:
    """One engine step with a stand-in model; returns (sequences scheduled, sequences finished)."""
    for seq in sched.running:
        if not seq.in_prefill and spec:
            seq.spec_token_ids = [
                rng.randrange(6) for _ in range(min(spec, max_model_len - seq.num_tokens - 1))
            ]
    out = sched.schedule()
    sampled = []
    for item in out.scheduled:
        accepted = rng.randint(0, item.num_spec_tokens) if item.sample else 0
        sampled.append(item.seq.spec_token_ids[:accepted] + [rng.randrange(6)] if item.sample else [])
    finished = len(out.finished)
    for seq, _ in sched.update(out, sampled):  # the engine's length rules
        limit = seq.params.max_tokens
        if seq.num_tokens >= max_model_len or (limit is not None and seq.num_output_tokens >= limit):
            del seq.token_ids[min(max_model_len, seq.num_prompt_tokens + (limit or max_model_len)) :]
            sched.finish(seq, "length")
            finished += 1
    return len(out.scheduled), finished


def test_a_sequence_alone_that_cannot_grow_ends_with_length_and_the_queue_moves():
    kv = BlockManager(4, BS)  # 16 slots, but the context allows 256 tokens
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    hog = _seq(0, [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True))
    small = _seq(1, [4, 5], SamplingParams(max_tokens=2))
    sched.add(hog)
    sched.add(small)
    rng = random.Random(0)
    for _ in range(100):
        if not sched.has_unfinished():
            break
        scheduled, finished = _step(sched, rng, spec=3, max_model_len=256)
        assert scheduled or finished, "a step with work queued did nothing"
    assert hog.finish_reason == "length" and hog.num_tokens == 17  # 16 slots hold all but the last token
    assert small.finish_reason == "length" and small.num_output_tokens == 2
    assert kv.num_free_blocks == 4


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_blocks=st.integers(2, 14),
    len_blocks=st.integers(1, 20),  # max_model_len in blocks: larger than the cache in some examples
    max_seqs=st.integers(1, 5),
    budget=st.integers(1, 24),
    requests=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=12),
            st.integers(1, 3),
            st.one_of(st.none(), st.integers(1, 12)),
        ),
        min_size=1,
        max_size=6,
    ),
    spec=st.integers(0, 3),
    caching=st.booleans(),
)
def test_random_mixes_on_tiny_caches_always_make_progress(
    seed, num_blocks, len_blocks, max_seqs, budget, requests, spec, caching
):
    rng = random.Random(seed)
    max_model_len = len_blocks * BS
    kv = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    sched = Scheduler(kv, max_seqs, budget, max_model_len)
    seqs, ids = [], iter(range(10_000))
    for prompt, n, max_tokens in requests:
        prompt = prompt[: max(1, min(max_model_len - 1, num_blocks * BS - 1))]  # what _check_request admits
        parent = None
        for _ in range(n):
            seq = _seq(next(ids), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), parent)
            parent = parent or seq
            seqs.append(seq)
            sched.add(seq)
    for _ in range(2_000):
        if not sched.has_unfinished():
            break
        scheduled, finished = _step(sched, rng, spec, max_model_len)
        assert scheduled or finished, (
            f"no progress with {len(sched.waiting)} waiting, {len(sched.running)} running"
        )
    assert not sched.has_unfinished(), "requests starved"
    assert kv.num_free_blocks == num_blocks, "KV blocks leaked"
    assert all(s.finish_reason == "length" for s in seqs)


# -- n > 1: siblings share prompt blocks only ---------------------------------------------------------------
def test_a_preempted_sample_readmitted_beside_its_sibling_adopts_prompt_blocks_only():
    kv = BlockManager(16, BS, enable_prefix_caching=False, debug=False)  # blocks filled by hand
    params = SamplingParams(n=2)
    parent = _seq(0, list(range(9)), params)  # two full prompt blocks and one token
    child = _seq(1, list(range(9)), params, parent)
    for seq in (parent, child):
        kv.allocate(seq, 9)
    parent.num_computed_tokens = 9
    parent.token_ids += [20, 21, 22, 23, 24, 25, 26]  # the parent ran ahead: block 2 now holds its samples
    parent.num_computed_tokens = 16
    kv.allocate(parent, 16)
    child.token_ids += [30, 31, 32, 33, 34, 35, 36]  # the child's own samples, then it was preempted
    kv.free_seq(child)
    assert kv.shared_prefix(parent, child) == parent.block_table[:2]


@pytest.mark.slow
@pytest.mark.parametrize("caching", [True, False])
def test_seeded_n2_output_is_the_same_with_a_tiny_and_a_large_cache(tiny_llama, caching):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=48, ignore_eos=True)
    prompt = list(range(100, 113))
    results, preemptions = [], []
    for blocks in (16, 200):  # 16 blocks of 4: one full context, so the two samples preempt each other
        llm = LLM(
            model=tiny_llama,
            block_size=4,
            num_kv_blocks=blocks,
            max_model_len=64,
            enable_prefix_caching=caching,
        )
        out = llm.generate(prompt, params)[0]
        results.append([o.token_ids for o in out.outputs])
        preemptions.append(llm.engine.stats.num_preemptions)
        assert llm.engine.kv_blocks_in_use() == 0
    assert preemptions[0] > 0 and preemptions[1] == 0
    assert results[0] == results[1]


def test_the_debug_check_catches_a_block_cached_for_tokens_it_does_not_hold():
    kv = BlockManager(8, BS, debug=True)
    a = _seq(0, [1, 2, 3, 4, 5], SamplingParams())
    kv.allocate(a, 5)
    kv.note_computed(a, 0, [1, 2, 3, 4, 5])
    b = _seq(1, [1, 2, 3, 9, 5], SamplingParams())
    b.block_table = list(a.block_table)  # adopts a's blocks although its third token differs
    b.num_computed_tokens = 4
    with pytest.raises(KVContentError):
        kv.cache_full_blocks(b)
    with pytest.raises(KVContentError):
        kv.note_computed(b, 4, [5])
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)  # a's own block is fine
