"""Pooling requests (SamplingParams.pooling, vLLM's embed runner for decoder models): the prompt's final
hidden states, pooled and L2-normalised, equal transformers' `last_hidden_state` on the same checkpoint,
batched with prompts of different lengths, under chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine.model_source import resolve_model
from specfleet.engine.sampling_params import ParameterError, SamplingParams

PROMPTS = [list(range(100, 107)), list(range(200, 233)), [300, 301], list(range(100, 141))]
TOL = 1e-4  # float32 on both sides: the two only differ in summation order


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(resolve_model(tiny_llama).path, torch_dtype=torch.float32).eval()

    def embed(ids: list[int], how: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        pooled = hidden[-1] if how == "LAST" else hidden.mean(dim=0)
        return torch.nn.functional.normalize(pooled, dim=0)

    return embed


def _run(llm, how: str, prompts=PROMPTS):
    return llm.generate(prompts, SamplingParams(pooling=how, max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("how", ["LAST", "MEAN"])
def test_embeddings_equal_transformers_hidden_states(make_tiny, reference, how):
    llm = make_tiny(max_num_batched_tokens=16)  # the longer prompts prefill in chunks, beside the others
    first = _run(llm, how)
    again = _run(llm, how)  # the second time LAST finds the prompts' full blocks in the prefix cache
    for outs in (first, again):
        for prompt, out in zip(PROMPTS, outs):
            assert out.finished and out.embedding is not None
            got = torch.tensor(out.embedding)
            assert got.shape == (llm.engine.runner.model.args.hidden_size,)
            torch.testing.assert_close(got, reference(prompt, how), atol=TOL, rtol=0)
    hits = [out.num_cached_tokens for out in again]
    assert any(hits) if how == "LAST" else not any(hits), hits
    assert llm.engine.kv_blocks_in_use() == 0


def test_generation_requests_carry_no_embedding(tiny):
    out = tiny.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.embedding is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pooling": "CLS"}, "pooling='CLS' must be one of LAST, MEAN"),
        ({"pooling": "LAST", "max_tokens": 4}, "max_tokens=4"),
        ({"pooling": "MEAN", "max_tokens": 1, "n": 2}, "n=2"),
    ],
)
def test_bad_pooling_params_name_the_field(kwargs, needle):
    with pytest.raises(ParameterError, match=needle) as info:
        SamplingParams(**kwargs)
    assert info.value.param == "pooling"


def test_a_pooling_request_gets_no_proposals(make_tiny, reference):
    """A 17-token prompt in 16-token chunks: its last chunk is one token, so it leaves prefill before the
    step that ends it and the n-gram proposer finds the repeated pattern, but its max_tokens=1 leaves no
    room for a proposal (drafts there would be computed and thrown away)."""
    llm = make_tiny(max_num_batched_tokens=16, speculative_method="ngram", num_speculative_tokens=4)
    prompt = [5, 6, 7, 8] * 4 + [5]
    out = _run(llm, "LAST", [prompt])[0]
    torch.testing.assert_close(torch.tensor(out.embedding), reference(prompt, "LAST"), atol=TOL, rtol=0)
    assert llm.engine.stats.num_draft_tokens == 0
    assert llm.engine.kv_blocks_in_use() == 0
