"""Speculative decoding with greedy sampling gives exactly the non-speculative output, n-gram and draft,
across batching, chunked prefill, preemption and live k changes; every KV block of both models returns."""

from __future__ import annotations

import numpy as np
import pytest
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.spec_decode.make_draft import truncate_layers
from specfleet.engine.spec_decode.ngram import ngram_lookup

pytestmark = pytest.mark.slow

PASSAGE = (
    "The scheduler has no prefill or decode phase: each request's computed tokens catch up with its tokens "
    "within a per-step token budget. Chunked prefill, prefix hits, preemption and speculative tokens all "
    "follow from that one rule."
)
PROMPTS = [
    f"Repeat this passage word for word.\n\n{PASSAGE}\n\nRepeated:\n{PASSAGE[:40]}",
    f"Summarise in one sentence: {PASSAGE}\nSummary:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
]
N = 40


def greedy(k=None, n=N):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, num_speculative_tokens=k)


def tokens(results):
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(speculative_method="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def reference(ngram_llm):
    out = tokens(ngram_llm.generate(PROMPTS, greedy(k=0)))
    assert ngram_llm.engine.stats.num_drafts == 0, "k=0 must not speculate"
    return out


def test_ngram_single_requests_equal_non_speculative(ngram_llm, reference):
    before = ngram_llm.engine.stats.num_accepted_tokens
    for prompt, ref in zip(PROMPTS, reference):
        assert tokens(ngram_llm.generate([prompt], greedy())) == [ref]
    assert ngram_llm.engine.stats.num_accepted_tokens - before > N  # the copy task really speculated
    assert ngram_llm.engine.kv_blocks_in_use() == 0


def test_ngram_mixed_batch_only_some_speculate(ngram_llm, reference):
    params = [greedy(), greedy(k=0), greedy(), greedy(k=0)]
    assert tokens(ngram_llm.generate(PROMPTS, params)) == reference


def test_ngram_chunked_prefill_and_live_k_changes(ngram_llm, reference):
    engine = ngram_llm.engine
    engine.update_config(max_num_batched_tokens=24)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"live-{i}", prompt, greedy())
    done, step, ks = {}, 0, [1, 3, 0, 8, 2]
    while engine.has_unfinished_requests():
        if step % 5 == 0:
            engine.update_config(num_speculative_tokens=ks[(step // 5) % len(ks)])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    engine.update_config(max_num_batched_tokens=2048, num_speculative_tokens=4)
    assert [done[f"live-{i}"] for i in range(len(PROMPTS))] == reference


def test_ngram_disable_by_batch_size(ngram_llm, reference):
    """Above the limit a step proposes nothing; once the batch falls to it, drafts resume; the output is
    the non-speculative one throughout."""
    engine = ngram_llm.engine
    engine.update_config(speculative_disable_by_batch_size=1)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"guard-{i}", prompt, greedy(n=N + 8 * i))  # they finish one by one
        done, drafts_by_batch = {}, []
        while engine.has_unfinished_requests():
            batch = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            before = engine.stats.num_drafts
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            drafts_by_batch.append((batch, engine.stats.num_drafts - before))
    finally:
        engine.update_config(speculative_disable_by_batch_size=0)
    assert all(drafts == 0 for batch, drafts in drafts_by_batch if batch > 1)
    assert sum(drafts for batch, drafts in drafts_by_batch if batch == 1) > 0  # the last one speculated
    assert [done[f"guard-{i}"][:N] for i in range(len(PROMPTS))] == reference
    assert engine.kv_blocks_in_use() == 0


def replay_shadow(prompt_ids: list[int], output: list[int], length: int) -> tuple[int, int, list[int]]:
    """The shadow drafts one sequence decoding alone gets, from its tokens (the output runs to max_tokens): a
    lookup at every step it holds no draft (the first once the prompt is in, the next after the draft's
    first differing token or its last), as long as a verified draft could be there (the k-room rule: the
    output left, less the bonus token; none on the last step), scored against the tokens after it."""
    tokens = [*prompt_ids, *output]
    lookups = drafts = 0
    accepted = [0] * length
    pos = len(prompt_ids) + 1  # the prefill step emits the first token
    while (room := len(tokens) - pos - 1) > 0:
        draft = ngram_lookup(np.asarray(tokens[:pos]), min(length, room), 1, 4)
        if not draft:
            lookups, pos = lookups + 1, pos + 1
            continue
        emitted = tokens[pos : pos + len(draft)]
        matched = next((i for i, (d, t) in enumerate(zip(draft, emitted)) if d != t), len(emitted))
        lookups, drafts = lookups + 1, drafts + 1
        for i in range(matched):
            accepted[i] += 1
        pos += min(matched + 1, len(draft))
    return lookups, drafts, accepted


def test_ngram_shadow_drafts_at_k0_score_what_verification_would_accept(ngram_llm, reference):
    """With k = 0 the engine scores n-gram lookups against the tokens that follow: exactly the replay of
    the same lookups over the output, and close to what verified drafts accept on the same prompts."""
    engine = ngram_llm.engine
    length = engine.config.max_num_speculative_tokens
    expected = (0, 0, [0] * length)
    for prompt, ref in zip(PROMPTS, reference):  # one at a time: the replay assumes a sequence alone
        before = (
            engine.stats.shadow_lookups,
            engine.stats.shadow_drafts,
            list(engine.stats.shadow_accepted_per_pos),
        )
        assert tokens(ngram_llm.generate([prompt], greedy(k=0))) == [ref]
        got = (
            engine.stats.shadow_lookups - before[0],
            engine.stats.shadow_drafts - before[1],
            [a - b for a, b in zip(engine.stats.shadow_accepted_per_pos, before[2] or [0] * length)],
        )
        want = replay_shadow(engine.tokenizer.encode(prompt), ref, length)
        assert got == want, prompt[:30]
        expected = (
            expected[0] + want[0],
            expected[1] + want[1],
            [a + b for a, b in zip(expected[2], want[2])],
        )
    assert expected[1] > 10 and expected[2][0] > 0  # the copy prompt found and matched drafts

    verified = engine.stats.num_drafts, list(engine.stats.accepted_per_pos)
    ngram_llm.generate(PROMPTS, greedy(k=length))
    drafts = engine.stats.num_drafts - verified[0]
    first = (engine.stats.accepted_per_pos[0] - (verified[1] or [0])[0]) / drafts
    # the same quantity from other starting points: a draft after a miss starts one token later
    assert abs(expected[2][0] / expected[1] - first) < 0.15


def test_ngram_preemption_mid_speculation(reference):
    llm = LLM(
        speculative_method="ngram",
        num_speculative_tokens=4,
        num_kv_blocks=14,
        max_num_seqs=4,
        max_model_len=14 * 16,
    )
    assert tokens(llm.generate(PROMPTS, greedy())) == reference
    assert llm.engine.stats.num_preemptions > 0 and llm.engine.stats.num_drafts > 0
    assert llm.engine.kv_blocks_in_use() == 0


def test_draft_model_equals_non_speculative(reference, tmp_path_factory, bundled_path):
    draft = truncate_layers("bundled://smollm2-135m-instruct", 2, tmp_path_factory.mktemp("draft"))
    llm = LLM(
        speculative_method="draft",
        num_speculative_tokens=3,
        draft_model=f"file://{draft}",
        max_num_batched_tokens=64,
    )
    params = [greedy(), greedy(k=0), greedy(), greedy()]
    assert tokens(llm.generate(PROMPTS, params)) == reference
    stats = llm.engine.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert llm.engine.kv_blocks_in_use() == 0
    assert llm.engine.proposer.blocks_in_use() == 0


def test_int8_copy_of_the_target_is_an_exact_and_useful_draft(reference):
    """The quantized-copy draft: the target's own weights in int8. Output stays the target's; the draft
    agrees with it on most tokens (the layer-truncated drafts above agree on few)."""
    from specfleet.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("the int8 draft runs on the native CPU kernels, which did not build here")
    llm = LLM(
        speculative_method="draft",
        num_speculative_tokens=4,
        draft_model="bundled://smollm2-135m-instruct",
        draft_quantization="int8",
    )
    assert tokens(llm.generate(PROMPTS, greedy())) == reference
    stats = llm.engine.stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.6
    assert llm.engine.kv_blocks_in_use() == 0 and llm.engine.proposer.blocks_in_use() == 0


def test_draft_model_preemption_and_abort(reference, tmp_path_factory):
    draft = truncate_layers("bundled://smollm2-135m-instruct", 1, tmp_path_factory.mktemp("draft1"))
    llm = LLM(
        speculative_method="draft",
        num_speculative_tokens=2,
        draft_model=f"file://{draft}",
        num_kv_blocks=14,
        max_num_seqs=4,
        max_model_len=14 * 16,
    )
    assert tokens(llm.generate(PROMPTS, greedy())) == reference
    assert llm.engine.stats.num_preemptions > 0
    engine = llm.engine
    engine.add_request("gone", PROMPTS[0], greedy())
    for _ in range(3):
        engine.step()
    engine.abort("gone")
    assert engine.kv_blocks_in_use() == 0 and engine.proposer.blocks_in_use() == 0


def test_draft_with_a_different_vocabulary_is_refused(tmp_path):
    import json
    import shutil

    draft = truncate_layers("bundled://smollm2-135m-instruct", 1, tmp_path / "d")
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab["zz-not-in-target"] = vocab.pop(first)
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    shutil.rmtree(tmp_path / "unused", ignore_errors=True)
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(speculative_method="draft", num_speculative_tokens=2, draft_model=f"file://{draft}")
