"""The offline API as a vLLM user writes it: keyword names, prompt dicts, vLLM's LLM(...) spellings, and the
SamplingParams vLLM has, each checked against transformers' own logits processors where one exists."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine import LLM, PositionLogprobs, SamplingParams
from specfleet.engine.llm import engine_config_from_vllm_kwargs
from specfleet.engine.sampler import SamplingBatch, processed_probs, sample

pytestmark = pytest.mark.slow

PROMPT = [101, 202, 303, 404, 505, 606, 707, 101, 202]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(model=tiny_llama, block_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_llama.removeprefix("file://"), dtype=torch.float32
    ).eval()


def _hf_greedy(hf, n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw
        )
    return out[0, len(PROMPT) :].tolist()


def test_keyword_names_and_prompt_dicts(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    positional = tiny.generate(PROMPT, greedy)[0].outputs[0].token_ids
    by_name = tiny.generate({"prompt_token_ids": PROMPT}, sampling_params=greedy)[0].outputs[0].token_ids
    assert positional == by_name
    text = tiny.tokenizer.decode(PROMPT)
    assert tiny.generate([{"prompt": text}], sampling_params=greedy)[0].prompt == text
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny.generate({"prompt_ids": PROMPT}, greedy)
    chat = tiny.chat([{"role": "user", "content": "hi"}], sampling_params=greedy)
    assert len(chat[0].outputs[0].token_ids) == 6


def test_vllm_engine_spellings_map_onto_the_config():
    config = engine_config_from_vllm_kwargs(
        "bundled://x",
        {
            "gpu_memory_utilization": 0.7,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5},
        },
    )
    assert (
        config.kv_cache_memory_fraction,
        config.speculative_method,
        config.num_speculative_tokens,
        config.prompt_lookup_max,
    ) == (0.7, "ngram", 3, 5)
    draft = engine_config_from_vllm_kwargs(
        "bundled://x",
        {"speculative_config": {"model": "bundled://d", "num_speculative_tokens": 2, "quantization": "int8"}},
    )
    assert (draft.speculative_method, draft.draft_model, draft.draft_quantization) == (
        "draft",
        "bundled://d",
        "int8",
    )
    with pytest.raises(ValueError, match="eagle"):
        engine_config_from_vllm_kwargs("bundled://x", {"speculative_config": {"method": "eagle"}})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        engine_config_from_vllm_kwargs(
            "bundled://x", {"speculative_config": {"method": "ngram", "draft_tensor_parallel_size": 1}}
        )


def test_repetition_penalty_matches_transformers(tiny, hf):
    ours = (
        tiny.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert ours == _hf_greedy(hf, 16, repetition_penalty=1.3)
    assert ours != _hf_greedy(hf, 16)  # the penalty changed the output


def test_bad_words_match_transformers(tiny, hf):
    plain = _hf_greedy(hf, 16)
    word = tiny.tokenizer.decode([plain[0]]).strip()
    variants = [tiny.tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    ours = (
        tiny.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word])
        )[0]
        .outputs[0]
        .token_ids
    )
    assert ours == _hf_greedy(hf, 16, bad_words_ids=variants)
    assert plain[0] not in ours


def test_logit_bias_and_allowed_token_ids(tiny):
    forced = (
        tiny.generate(
            PROMPT, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logit_bias={4242: 100.0})
        )[0]
        .outputs[0]
        .token_ids
    )
    assert forced == [4242] * 8
    allowed = (
        tiny.generate(
            PROMPT,
            SamplingParams(
                temperature=1.0, max_tokens=32, ignore_eos=True, seed=1, allowed_token_ids=[7, 8, 9]
            ),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert set(allowed) <= {7, 8, 9} and len(set(allowed)) > 1


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]]).repeat(4000, 1)
    batch = SamplingBatch(
        temperature=torch.ones(4000),
        top_k=None,
        top_p=None,
        noise_keys=[None] * 4000,
        all_greedy=False,
        min_p=torch.full((4000,), 0.3),
    )
    probs = processed_probs(logits, batch)
    assert probs[0, 2:].eq(0).all() and probs[0, :2].sum() == pytest.approx(1.0)  # e^-2 < 0.3 <= e^-1
    tokens = sample(logits, batch, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}


def test_prompt_logprobs_cumulative_logprob_and_vllm_shape(tiny, hf):
    out = tiny.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    )[0]
    with torch.no_grad():
        logp = hf(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert entry[PROMPT[pos]].logprob == pytest.approx(float(logp[pos - 1, PROMPT[pos]]), abs=1e-3)
        assert entry[PROMPT[pos]].rank == int((logp[pos - 1] > logp[pos - 1, PROMPT[pos]]).sum()) + 1
    completion = out.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))
    first = completion.logprobs[0]
    assert isinstance(first, PositionLogprobs) and next(iter(first)) == completion.token_ids[0]
    assert first[completion.token_ids[0]].rank == 1  # greedy: the most likely token
    assert first[completion.token_ids[0]].decoded_token == tiny.tokenizer.decode([completion.token_ids[0]])
    assert first.token_id == completion.token_ids[0] and len(first.top) == 2  # the old fields still read


def test_prompt_logprobs_survive_a_prefix_cache_hit(tiny):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    tiny.generate(PROMPT * 3, SamplingParams(temperature=0, max_tokens=2))  # fills the prefix cache
    out = tiny.generate(PROMPT * 3, params)[0]
    assert out.num_cached_tokens == 0 and all(lp is not None for lp in out.prompt_logprobs[1:])


def test_truncate_prompt_tokens_and_special_tokens(tiny):
    out = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=4))[0]
    assert out.prompt_token_ids == PROMPT[-4:]
    special = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={special: 100.0})
    hidden = tiny.generate(PROMPT, SamplingParams(**params))[0].outputs[0]
    shown = tiny.generate(PROMPT, SamplingParams(**params, skip_special_tokens=False))[0].outputs[0]
    assert hidden.token_ids == shown.token_ids == [special] * 3
    assert hidden.text == "" and shown.text == "<|im_end|>" * 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("repetition_penalty", 0.0, "repetition_penalty=0.0 must be > 0"),
        ("min_p", 1.5, "min_p=1.5 must be between 0 and 1"),
        ("logit_bias", {5: 500.0}, "logit_bias\\[5\\]=500.0"),
        ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list"),
        ("prompt_logprobs", 21, "prompt_logprobs=21 must be between 0 and 20"),
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens=0 must be >= 1"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_token_ids_beyond_the_vocabulary_are_refused(tiny):
    for params in (SamplingParams(logit_bias={10**6: 1.0}), SamplingParams(allowed_token_ids=[10**6])):
        with pytest.raises(ValueError, match=r"(logit_bias|allowed_token_ids) must be in \[0, 49152\)"):
            tiny.generate(PROMPT, params)
    assert tiny.engine.kv_blocks_in_use() == 0
