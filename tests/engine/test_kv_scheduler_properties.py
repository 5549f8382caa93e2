"""The block manager and scheduler driven without a model, by hypothesis: invariants hold on every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.engine.block_manager import BlockManager
from specfleet.engine.config import SCHEDULING_POLICIES
from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.scheduler import Scheduler
from specfleet.engine.sequence import Sequence

BS = 4


def check_invariants(kv: BlockManager, sched: Scheduler) -> None:
    refs = [0] * kv.num_blocks
    for seq in sched.running:
        for b in seq.block_table:
            refs[b] += 1
    assert refs == kv.ref_counts, "reference counts disagree with the block tables"
    for b in range(kv.num_blocks):
        assert (b in kv.free) == (kv.ref_counts[b] == 0), f"block {b} both free and referenced (or neither)"
    for seq in sched.waiting:
        assert not seq.block_table
    for h, b in kv.hash_to_block.items():
        assert kv.block_hash[b] == h


def _fake_model_step(sched: Scheduler, out, rng: random.Random) -> None:
    """Stand in for the runner: a sampling sequence gets 1 token, plus accepted proposals if any."""
    sampled = []
    for item in out.scheduled:
        if not item.sample:
            sampled.append([])
            continue
        accepted = rng.randint(0, item.num_spec_tokens)
        sampled.append(item.seq.spec_token_ids[:accepted] + [rng.randrange(6)])
    sched.update(out, sampled)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_blocks=st.integers(10, 40),
    max_seqs=st.integers(1, 6),
    budget=st.integers(4, 40),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=8),
    spec=st.integers(0, 3),
)
def test_scheduler_and_blocks_keep_invariants(seed, num_blocks, max_seqs, budget, prompts, spec):
    rng = random.Random(seed)
    kv = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_seqs, budget, max_model_len=64)
    seqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=rng.randint(1, 12))
        seq = Sequence(i, f"r{i}", 0, list(p), len(p), params)
        seqs.append(seq)
        sched.add(seq)
    aborted = set()
    for _ in range(400):
        if not sched.has_unfinished():
            break
        for seq in sched.running:
            if not seq.in_prefill and spec:
                seq.spec_token_ids = [rng.randrange(6) for _ in range(spec)]
        out = sched.schedule()
        assert len(out.scheduled) <= max_seqs
        assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled) <= budget
        _fake_model_step(sched, out, rng)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        if rng.random() < 0.05 and sched.running:
            victim = rng.choice(sched.running)
            aborted.add(victim.seq_id)
            sched.finish(victim, "abort")
        check_invariants(kv, sched)
    assert not sched.has_unfinished(), "requests starved"
    assert kv.num_free_blocks == num_blocks, "blocks leaked after every request finished or aborted"
    assert all(s.finish_reason in ("length", "abort") for s in seqs)


@settings(max_examples=80, deadline=None)
@given(
    a=st.lists(st.integers(0, 2), min_size=1, max_size=24),
    b=st.lists(st.integers(0, 2), min_size=1, max_size=24),
)
def test_prefix_hits_only_on_identical_full_blocks(a, b):
    kv = BlockManager(32, BS, debug=False)  # blocks filled by hand, not computed
    first = Sequence(0, "a", 0, list(a), len(a), SamplingParams())
    kv.allocate(first, len(a))
    first.num_computed_tokens = len(a)
    kv.cache_full_blocks(first)
    second = Sequence(1, "b", 0, list(b), len(b), SamplingParams())
    hits = kv.lookup_prefix(second)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    expected = min(common // BS, (len(b) - 1) // BS, len(a) // BS)
    assert len(hits) == expected
    assert hits == first.block_table[: len(hits)]


def test_lru_eviction_keeps_recent_cached_blocks():
    kv = BlockManager(4, BS, debug=False)  # blocks filled by hand, not computed
    seqs = []
    for i in range(2):  # two sequences, two cached blocks each
        s = Sequence(i, f"r{i}", 0, [i] * 9, 9, SamplingParams())
        kv.allocate(s, 8)
        s.num_computed_tokens = 8
        kv.cache_full_blocks(s)
        seqs.append(s)
    kv.free_seq(seqs[0])  # freed first: evicted first
    kv.free_seq(seqs[1])
    newcomer = Sequence(9, "n", 0, [7] * 9, 9, SamplingParams())
    kv.allocate(newcomer, 8)
    assert kv.lookup_prefix(Sequence(10, "x", 0, [1] * 9, 9, SamplingParams())) != []
    assert kv.lookup_prefix(Sequence(11, "y", 0, [0] * 9, 9, SamplingParams())) == []


def test_trim_frees_rejected_tail_blocks():
    kv = BlockManager(8, BS)
    s = Sequence(0, "r", 0, [1, 2, 3], 3, SamplingParams())
    kv.allocate(s, 12)
    assert kv.num_free_blocks == 5
    kv.trim(s, 5)
    assert len(s.block_table) == 2 and kv.num_free_blocks == 6


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    depth=st.integers(2, 3),
    num_blocks=st.integers(10, 40),
    max_seqs=st.integers(1, 6),
    budget=st.integers(4, 40),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=8),
    spec=st.integers(0, 3),
    policy=st.sampled_from(SCHEDULING_POLICIES),
)
def test_pipelined_micro_batches_never_touch_sequences_in_flight(
    seed, depth, num_blocks, max_seqs, budget, prompts, spec, policy
):
    # The engine's pipelined step, without a model: up to `depth` micro-batches in flight, the oldest
    # completed each step. A sequence in flight is never scheduled again, preempted or given new blocks
    # by another micro-batch, and every request still finishes without a leaked block.
    from collections import deque

    rng = random.Random(seed)
    kv = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_seqs, budget, max_model_len=64, policy=policy)
    sched.micro_batches = depth
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=rng.randint(1, 12))
        # under the priority policy, random priorities: a displacement must pass over sequences in flight
        sched.add(Sequence(i, f"r{i}", 0, list(p), len(p), params, priority=rng.randint(-2, 2)))
    flight: deque = deque()
    for _ in range(800):
        if not sched.has_unfinished() and not flight:
            break
        while len(flight) < depth:
            busy = frozenset(item.seq.seq_id for out, _ in flight for item in out.scheduled)
            for seq in sched.running:
                if not seq.in_prefill and spec and seq.seq_id not in busy and not seq.spec_token_ids:
                    seq.spec_token_ids = [rng.randrange(6) for _ in range(spec)]
            out = sched.schedule(busy)
            assert len(out.scheduled) <= max_seqs and len(sched.running) <= max_seqs * depth
            assert not busy & {item.seq.seq_id for item in out.scheduled}, (
                "a sequence in flight was scheduled"
            )
            if out.empty:
                break
            tables = {item.seq.seq_id: list(item.seq.block_table) for item in out.scheduled}
            flight.append((out, tables))
        for out, tables in flight:  # nothing in flight lost or changed its blocks
            for item in out.scheduled:
                if not item.seq.is_finished:
                    assert (
                        item.seq.status.name == "RUNNING" and item.seq.block_table == tables[item.seq.seq_id]
                    )
        if flight:
            out, _ = flight.popleft()
            _fake_model_step(sched, out, rng)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        if rng.random() < 0.05 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")  # in flight or not
        check_invariants(kv, sched)
    assert not sched.has_unfinished() and not flight, "requests starved"
    assert kv.num_free_blocks == num_blocks, "blocks leaked after every request finished or aborted"
