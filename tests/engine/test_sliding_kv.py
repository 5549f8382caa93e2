"""Sliding-window layers that keep only their window (engine/block_manager.py's second pool): the block
manager and scheduler driven without a model (every position a query reads checked against the tokens its
K/V came from, SPECFLEET_KV_DEBUG), the pools' sizes, and Gemma 2 and Gemma 3 engines generating past
several windows against transformers: a mixed batch, chunked prefill, preemption, prefix-cache hits and
n > 1 samples sharing their prompt's blocks, with each sequence's sliding blocks bounded by its window."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config, write_tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.engine.block_manager import NULL_BLOCK, BlockManager, PrefixHits, SlidingLayers
from specfleet.engine.config import EngineConfig
from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.scheduler import Scheduler
from specfleet.engine.sequence import Sequence

BS = 4


def _held(seq: Sequence) -> int:
    return sum(b != NULL_BLOCK for b in seq.sliding_table)


def _window_bound(window: int, bs: int = BS) -> int:
    """Sliding blocks a sequence may hold between steps: its window before the next query, plus one block."""
    return -(-(window - 1) // bs) + 1


def _check(kv: BlockManager, sched: Scheduler, window: int) -> None:
    assert kv.sliding is not None
    refs = [0] * kv.sliding.num_blocks
    refs[NULL_BLOCK] = 1  # held for ever
    for seq in sched.running:
        assert len(seq.sliding_table) == len(seq.block_table)
        for b in seq.sliding_table:
            if b != NULL_BLOCK:
                refs[b] += 1
        assert _held(seq) <= _window_bound(window), f"{seq} holds {seq.sliding_table}"
        # the entries before the window are NULL, those inside it real blocks
        first = kv.first_in_window(seq.num_computed_tokens)
        assert all(b == NULL_BLOCK for b in seq.sliding_table[:first])
        assert NULL_BLOCK not in seq.sliding_table[first:]
    assert refs == kv.sliding.ref_counts, "sliding reference counts disagree with the sliding tables"
    for seq in sched.waiting:
        assert not seq.sliding_table


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    window=st.integers(1, 10),
    num_blocks=st.integers(12, 40),
    max_seqs=st.integers(1, 5),
    budget=st.integers(4, 24),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=6),
    spec=st.integers(0, 3),
)
def test_sliding_blocks_stay_in_the_window_and_every_read_is_exact(
    seed, window, num_blocks, max_seqs, budget, prompts, spec
):
    """Random prompts (of few distinct tokens: many prefix hits), proposals partly rejected, a cache small
    enough to preempt: after every step each sequence's sliding blocks cover its window (+1 block) and
    nothing before it, the reference counts match the tables, and (debug mode) every key a full or sliding
    layer reads was computed from the sequence's own prefix; in the end no block of either pool is held."""
    assert BlockManager(2, BS).debug, "tests run with SPECFLEET_KV_DEBUG=1 (tests/conftest.py)"
    rng = random.Random(seed)
    need = max_seqs * (_window_bound(window) + 1) + -(-budget // BS)
    kv = BlockManager(num_blocks, BS, sliding_window=window, num_sliding_blocks=min(num_blocks, need) + 1)
    sched = Scheduler(kv, max_seqs, budget, max_model_len=64)
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, f"r{i}", 0, list(p), len(p), SamplingParams(max_tokens=rng.randint(1, 30))))
    for _ in range(600):
        if not sched.has_unfinished():
            break
        for seq in sched.running:
            if not seq.in_prefill and spec:
                seq.spec_token_ids = [rng.randrange(3) for _ in range(spec)]
        out = sched.schedule()
        sampled = []
        for item in out.scheduled:
            accepted = rng.randint(0, item.num_spec_tokens)
            sampled.append(item.seq.spec_token_ids[:accepted] + [rng.randrange(3)] if item.sample else [])
        sched.update(out, sampled)
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        _check(kv, sched, window)
    assert not sched.has_unfinished(), "requests starved"
    assert kv.num_free_blocks == num_blocks and kv.num_used_sliding_blocks == 0, "blocks leaked"


def _computed(kv: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence whose tokens were all computed in one step (as a prefill chunk would)."""
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams())
    kv.allocate(seq, len(tokens))
    kv.note_computed(seq, 0, tokens)
    seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(seq)
    return seq


def test_a_prefix_hit_needs_its_window_in_the_sliding_pool():
    """The full pool holds all of a finished sequence's blocks; a hit of n blocks also needs the sliding
    blocks inside the window before position n * block_size, so when those are evicted the hit shrinks to
    a prefix whose window is still cached, and the new sequence's sliding table starts with NULL entries."""
    window = 6
    kv = BlockManager(32, BS, sliding_window=window, num_sliding_blocks=12)
    tokens = list(range(100, 141))  # 41 tokens: 10 full blocks
    first = _computed(kv, 0, tokens)
    assert _held(first) == 2 and kv.first_in_window(41) == 9  # positions 36.. (block 9, 10) are read next
    kv.free_seq(first)

    again = Sequence(1, "r1", 0, tokens + [7], 42, SamplingParams())
    hits = kv.lookup_prefix(again)
    assert isinstance(hits, PrefixHits) and len(hits) == 10  # the window of position 40: blocks 8 and 9
    assert hits.sliding[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in hits.sliding[8:]
    kv.allocate(again, 42, hits)
    again.num_computed_tokens = 40
    kv.note_computed(again, 40, again.token_ids[40:])  # the window it reads holds the right K/V
    kv.free_seq(again)

    # a newcomer takes every free sliding block: the cached ones are evicted, the full pool keeps its own
    other = Sequence(2, "r2", 0, [9] * 44, 44, SamplingParams())
    kv.allocate(other, 44)
    assert kv.sliding is not None and not kv.sliding.free
    assert kv.lookup_prefix(Sequence(3, "r3", 0, tokens + [7], 42, SamplingParams())) == []


def test_a_sibling_shares_no_further_than_the_window_its_parent_still_holds():
    kv = BlockManager(32, BS, sliding_window=5, num_sliding_blocks=16, enable_prefix_caching=False)
    prompt = list(range(18))
    parent = _computed(kv, 0, prompt)  # it lets go of blocks 0..2: its next query (18) reads 14..
    child = Sequence(1, "r1", 1, list(prompt), 18, SamplingParams(), parent=parent)
    shared = kv.shared_prefix(parent, child)
    assert isinstance(shared, PrefixHits) and len(shared) == 4  # (18 - 1) // 4 blocks; 16 reads 12..
    assert shared.sliding == [NULL_BLOCK] * 3 + [parent.sliding_table[3]] and parent.sliding_table[3]
    parent.token_ids += [1] * 14  # the parent generated on: the window before position 16 is gone
    kv.allocate(parent, 32)
    parent.num_computed_tokens = 32
    kv.cache_full_blocks(parent)
    assert kv.shared_prefix(parent, child) == []


def test_trim_and_hits_without_their_sliding_blocks():
    kv = BlockManager(16, BS, sliding_window=5, num_sliding_blocks=8)
    seq = Sequence(0, "r", 0, [1, 2, 3], 3, SamplingParams())
    kv.allocate(seq, 12)
    assert kv.sliding is not None and len(kv.sliding.free) == 4
    kv.trim(seq, 5)
    assert len(seq.sliding_table) == 2 and len(kv.sliding.free) == 5
    with pytest.raises(TypeError, match="lookup_prefix or shared_prefix"):
        kv.can_allocate(Sequence(1, "r1", 0, [1] * 9, 9, SamplingParams()), 9, [seq.block_table[0]])


def test_the_pools_share_the_memory_budget():
    """kv_cache_blocks over a Gemma 3 1B-shaped cache (6 layers of one KV head of 256, five sliding with a
    window of 1024): the sliding pool holds the windows of as many sequences as the full layers hold at
    max_model_len (each its window plus two blocks, and one step's token budget, and the null block),
    up to the live max_num_seqs ceiling; the full layers get the rest; with too little for one sequence in
    both, equal counts as full retention had."""
    from specfleet.engine.loader import bytes_per_block, kv_cache_blocks, sliding_blocks_needed

    # a stand-in for the loaded model: the sizing reads only its shape and dtype
    model = SimpleNamespace(
        args=SimpleNamespace(num_layers=6, num_kv_heads=1, head_dim=256), dtype=torch.float32
    )
    per_layer = bytes_per_block(model, 16) // 6  # 32 KiB: 16 tokens of K and V, float32
    window_blocks, chunk = 64 + 2, 8192 // 16  # per sequence; one step of the default 8192-token ceiling

    def sized(gib: float, max_model_len: int) -> tuple[int, int]:
        config = EngineConfig(
            model="x", max_num_seqs=8, max_num_seqs_limit=8, kv_cache_gib=gib, block_size=16
        )
        sliding = SlidingLayers(frozenset(range(5)), window=1024)
        full = kv_cache_blocks(config, [model], max_model_len, torch.device("cpu"), sliding=sliding)
        assert full * per_layer + sliding.num_blocks * 5 * per_layer <= gib * 2**30
        return full, sliding.num_blocks

    config = EngineConfig(model="x", max_num_seqs=8, max_num_seqs_limit=8)
    assert sliding_blocks_needed(config, 1024) == 8 * window_blocks + chunk
    # 1 GiB: the windows of all 8 sequences; the full layers every block 8 sequences of 8k could use
    assert sized(1.0, 8192) == (8 * 512 + 1, 8 * window_blocks + chunk + 1)
    # 0.25 GiB: 6 sequences of 8k in both pools (all-global, the same memory held 1365 blocks: 2 of them)
    full, sliding_blocks = sized(0.25, 8192)
    assert sliding_blocks == 6 * window_blocks + chunk + 1 and full // 512 >= 6
    assert (0.25 * 2**30) // (6 * per_layer) // 512 == 2
    # 0.03 GiB: not one sequence of 2k in both pools at those sizes: equal counts
    full, sliding_blocks = sized(0.03, 2048)
    assert sliding_blocks == full + 1 and full == (0.03 * 2**30 - 5 * per_layer) // (6 * per_layer)


def test_a_gemma_whose_every_layer_slides_keeps_one_pool():
    """A Gemma 3 of fewer than six layers slides on every layer: no full layer sizes a main pool, so there
    is no second pool (every layer keeps the whole sequence; its attention still bounds the window) and the
    cache is sized as for any model (a division by the full layers' zero bytes before)."""
    from helpers import tiny_state
    from specfleet.engine.loader import kv_cache_blocks, sliding_layers
    from specfleet.engine.models.gemma import Gemma3Model

    config = tiny_config("gemma3", num_hidden_layers=2, head_dim=16, sliding_window=5, vocab_size=256)
    model = Gemma3Model(config, tiny_state(config), torch.float32, torch.device("cpu"))
    assert model.sliding_layer_indices() == [0, 1]
    assert sliding_layers(model, 64) is None
    blocks = kv_cache_blocks(EngineConfig(model="x", kv_cache_gib=0.01), [model], 64, torch.device("cpu"))
    assert blocks > 0


# -- Gemma 2 and 3 engines past several windows, against transformers ---------------------------------

WINDOW = 16
PROMPTS = [
    [(7 * i + 3) % 900 + 10 for i in range(45)],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6] * 3,
    [11, 12, 13, 14, 15] * 6,
]
NEW = 40  # the longest sequence reaches 85 tokens: past five windows of 16
COMMON = dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24)
CASES = {
    "gemma2": ("gemma2", {}),  # layers 0 and 2 sliding, soft-capped
    "gemma3": (
        "gemma3",
        dict(
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1e6,
        ),
    ),
}


def _reference(model, prompts, new: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0
            )
            out.append(seq[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory, bundled_path):
    """(model URL, reference tokens of PROMPTS, a prompt continuing the first sequence and its reference)."""
    from helpers import tiny_model

    kind, extra = CASES[request.param]
    config = tiny_config(kind, **COMMON, **extra)
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(path, config, std=0.2, tokenizer_from=bundled_path)
    model = tiny_model(config, std=0.2)
    ref = _reference(model, PROMPTS, NEW)
    follow = PROMPTS[0] + ref[0]  # 85 tokens: the first sequence's blocks are prefix hits for it
    return f"file://{path}", ref, follow, _reference(model, [follow], 8)[0]


def _watch(llm, window: int) -> dict[str, int]:
    """After every step: each running sequence's sliding blocks within its window (+1 block); returns the
    peaks of the sliding table's length (NULL entries included) and of the blocks held in each pool."""
    engine, peaks = llm.engine, {"table": 0, "full": 0, "sliding": 0}
    step = engine.step

    def checked_step():
        outputs = step()
        for seq in engine.scheduler.running:
            assert _held(seq) <= _window_bound(window), f"{seq} holds {seq.sliding_table}"
            peaks["table"] = max(peaks["table"], len(seq.sliding_table))
        peaks["full"] = max(peaks["full"], engine.kv.num_used_blocks)
        peaks["sliding"] = max(peaks["sliding"], engine.kv.num_used_sliding_blocks)
        return outputs

    engine.step = checked_step
    return peaks


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_window_only_cache_matches_transformers_with_preemption_and_chunked_prefill(gemma):
    """40 blocks of 4 slots hold two of the four sequences at once (the longest needs 22): the others are
    preempted and recomputed, mostly from prefix hits in both pools; a 16-token step budget splits the
    prompts into chunks. Every sequence's sliding blocks stay within its window, far below its length."""
    from specfleet.engine import LLM

    url, ref, _, _ = gemma
    llm = LLM(model=url, block_size=BS, num_kv_blocks=40, max_model_len=96, max_num_batched_tokens=16)
    assert llm.engine.kv.window == WINDOW and llm.engine.runner.sliding is not None
    peaks = _watch(llm, WINDOW)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert _tokens(llm.generate(PROMPTS, params)) == ref
    assert llm.engine.stats.num_preemptions > 0
    assert peaks["table"] >= 20  # sequences of 80+ tokens ...
    assert peaks["sliding"] < peaks["full"]  # ... held fewer sliding blocks than full ones
    assert llm.engine.kv_blocks_in_use() == 0
    llm.close()


@pytest.mark.slow
def test_window_only_cache_prefix_hits_and_shared_samples_match_transformers(gemma):
    """Sliding pool sized by the live limits (2 sequences, 16-token steps: 17 blocks with the null one);
    a prompt that continues a finished sequence hits the prefix cache of both pools past several windows;
    n = 2 greedy samples share their prompt's blocks; the n-gram proposer's rejected drafts are trimmed."""
    from specfleet.engine import LLM
    from specfleet.engine.loader import sliding_blocks_needed

    url, ref, follow, follow_ref = gemma
    limits = dict(max_num_seqs=2, max_num_seqs_limit=2, max_num_batched_tokens=16)
    llm = LLM(
        model=url,
        block_size=BS,
        max_model_len=96,
        kv_cache_gib=0.01,
        max_num_batched_tokens_limit=16,
        speculative_method="ngram",
        num_speculative_tokens=3,
        **limits,
    )
    kv = llm.engine.kv
    need = sliding_blocks_needed(llm.engine.config, WINDOW)
    assert kv.sliding is not None and kv.sliding.num_blocks == need + 1 == 17 < kv.num_blocks
    peaks = _watch(llm, WINDOW)
    plain = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert _tokens(llm.generate(PROMPTS[:1], plain)) == ref[:1]
    again = llm.generate([follow], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert _tokens(again) == [follow_ref]
    assert again[0].num_cached_tokens >= 4 * WINDOW  # the hit reaches past four windows
    assert _tokens(llm.generate(PROMPTS, plain)) == ref
    twins = llm.generate([PROMPTS[2]], SamplingParams(n=2, temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in twins[0].outputs] == [ref[2], ref[2]]
    assert peaks["sliding"] <= 2 * _window_bound(WINDOW) + 2
    assert llm.engine.kv_blocks_in_use() == 0
    llm.close()
