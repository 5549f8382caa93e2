"""Structured outputs in the engine (prototype integration): every output follows its schema, and greedy
structured output is the same with n-gram or int8-draft speculation as without."""

from __future__ import annotations

import json

import jsonschema
import pytest
from specfleet.engine import LLM, SamplingParams
from specfleet.engine.structured_output import StructuredOutputError

pytestmark = pytest.mark.slow

# numbers are bounded: a 135M model at temperature 0 may repeat a digit until max_tokens
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"enum": ["France", "Italy", "Spain", "Germany"]},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "country", "population_millions"],
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "languages": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            },
            "contact": {
                "type": "object",
                "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                "required": ["phone"],
            },
        },
        "required": ["name", "languages", "contact"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "step": {"type": "integer", "minimum": 1, "maximum": 9},
                "text": {"type": "string", "maxLength": 24},
            },
            "required": ["step", "text"],
        },
        "minItems": 2,
        "maxItems": 3,
    },
]
PROMPTS = [
    "Describe the capital of France as JSON with its city, country and population in millions.",
    "Give a JSON profile of a programmer named Ada who speaks English and French, with a phone number.",
    "List the steps to make tea as a JSON array of objects with step and text.",
]
MAX_TOKENS = 120


def chat(llm, params):
    return llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)


def params(k=None, temperature=0.0, seed=None):
    return [
        SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=MAX_TOKENS,
            num_speculative_tokens=k,
            structured_outputs={"json": schema},
        )
        for schema in SCHEMAS
    ]


def check_valid(results):
    for result, schema in zip(results, SCHEMAS):
        out = result.outputs[0]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(speculative_method="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def reference(ngram_llm):
    results = chat(ngram_llm, params(k=0))
    check_valid(results)
    return [r.outputs[0].token_ids for r in results]


def test_ngram_greedy_structured_equals_non_speculative(ngram_llm, reference):
    before = ngram_llm.engine.stats.num_draft_tokens
    results = chat(ngram_llm, params(k=4))
    assert [r.outputs[0].token_ids for r in results] == reference
    assert ngram_llm.engine.stats.num_draft_tokens > before  # it really speculated
    assert ngram_llm.engine.kv_blocks_in_use() == 0


def test_int8_draft_greedy_structured_equals_non_speculative(reference):
    llm = LLM(
        speculative_method="draft",
        num_speculative_tokens=4,
        draft_model="bundled://smollm2-135m-instruct",
        draft_quantization="int8",
    )
    results = chat(llm, params(k=4))
    assert [r.outputs[0].token_ids for r in results] == reference
    assert llm.engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize(("k", "seed"), [(0, 1), (4, 2)])
def test_sampled_structured_output_validates(ngram_llm, k, seed):
    check_valid(chat(ngram_llm, params(k=k, temperature=0.9, seed=seed)))


def test_choice_regex_and_min_tokens(ngram_llm):
    choices = ["positive", "negative", "neutral"]
    out = ngram_llm.generate(
        ["Review: I loved it. Sentiment:", "The date today (YYYY-MM-DD):"],
        [
            SamplingParams(
                temperature=0, max_tokens=20, min_tokens=8, structured_outputs={"choice": choices}
            ),
            SamplingParams(
                temperature=0.9,
                seed=0,
                max_tokens=20,
                structured_outputs={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
            ),
        ],
    )
    assert out[0].outputs[0].text in choices  # the grammar wins over min_tokens, and no NaN
    assert out[0].outputs[0].finish_reason == "stop"
    text = out[1].outputs[0].text
    assert len(text) == 10 and text[:2] == "20" and text[4] == "-" and text[7] == "-"


def test_grammar_that_cannot_finish_ends_with_length(ngram_llm):
    out = ngram_llm.generate(
        ["Count:"],
        SamplingParams(temperature=0, max_tokens=5, structured_outputs={"regex": "(one, ){20}one"}),
    )
    assert out[0].outputs[0].finish_reason == "length"


def test_ignore_eos_stops_when_the_grammar_ends(ngram_llm):
    out = ngram_llm.generate(
        ["Yes or no?"],
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, structured_outputs={"choice": ["yes", "no"]}
        ),
    )
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text.startswith(("yes", "no"))


def test_bad_schema_is_refused_before_queueing(ngram_llm):
    with pytest.raises(StructuredOutputError, match='Unsupported type "nope"'):
        ngram_llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "nope"}}))
    assert not ngram_llm.engine.has_unfinished_requests()
