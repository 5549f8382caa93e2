"""Greedy output equals transformers' greedy generate, token for token, on the bundled model.

One oracle run (HF generate, fp32, CPU) serves every engine path: a mixed batch, chunked prefill under a
small token budget, prefix-cache hits from a shared system prompt, and a KV pool small enough to preempt.
Each case also checks that the path it names was really taken.
"""

from __future__ import annotations

import pytest
import torch
from specfleet.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a logistics company. Answer in plain English, cite the relevant "
    "policy section, and keep every answer under one hundred words. Policies: shipping takes three to "
    "five business days; returns are accepted within thirty days with a receipt; damaged goods are "
    "replaced free of charge. Question: "
)
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old clockmaker who",
    "List three prime numbers:",
    SYSTEM + "How long does shipping take?",
    SYSTEM + "Can I return a jacket after two weeks?",
    SYSTEM + "My parcel arrived broken. What now?",
    "Translate to French: The weather is lovely today and we are going to the beach.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_reference(bundled_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_path)
    model = AutoModelForCausalLM.from_pretrained(bundled_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never mask
    # One left-padded batch (the mask keeps padding out of attention and positions): the same tokens as
    # one prompt at a time (checked on 2026-12-02), in a third of the time.
    tok.padding_side = "left"
    with torch.inference_mode():
        batch = tok(PROMPTS, return_tensors="pt", padding=True)
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0
        )
    refs = out[:, batch.input_ids.shape[1] :].tolist()
    assert all(len(r) == NEW_TOKENS for r in refs)
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _tokens(results):
    return [r.outputs[0].token_ids for r in results]


def test_prompts_span_several_blocks(bundled_path):
    from transformers import AutoTokenizer

    lengths = [len(AutoTokenizer.from_pretrained(bundled_path)(p).input_ids) for p in PROMPTS]
    assert max(lengths) > 3 * 16 and min(lengths) < 16


def test_mixed_batch_matches_transformers(hf_reference):
    llm = LLM(block_size=16)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_reference


def test_chunked_prefill_matches_transformers(hf_reference):
    llm = LLM(max_num_batched_tokens=24, enable_prefix_caching=False)
    steps_with_partial_prompt = []
    orig = llm.engine.scheduler.schedule

    def spy():
        out = orig()
        steps_with_partial_prompt.append(any(not i.sample for i in out.scheduled))
        return out

    llm.engine.scheduler.schedule = spy
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_reference
    assert any(steps_with_partial_prompt), "no prompt was split into chunks"


def test_prefix_cache_hits_match_transformers(hf_reference):
    llm = LLM()
    first = llm.generate(PROMPTS[4], GREEDY)  # computes and caches the shared system prompt
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(PROMPTS[5:7], GREEDY)
    assert all(r.num_cached_tokens >= 48 for r in rest), [
        r.num_cached_tokens for r in rest
    ]  # 3 shared blocks
    assert llm.engine.stats.prefix_cache_hits >= 96
    assert _tokens(first + rest) == hf_reference[4:7]


def test_preemption_matches_transformers(hf_reference):
    # 24 blocks of 16 slots hold ~3 of these sequences at once: the rest must be preempted and recomputed.
    llm = LLM(num_kv_blocks=24, max_num_seqs=8, max_model_len=24 * 16)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_reference
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv_blocks_in_use() == 0
