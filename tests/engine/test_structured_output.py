"""Structured outputs: masks from the bundled tokenizer's grammar keep every random walk valid, the
speculative rows equal one-token-at-a-time masks, rollback restores state, bad specs are typed errors."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from specfleet.engine.structured_output import (
    KINDS,
    GrammarBackend,
    StructuredOutputError,
    StructuredOutputSpec,
    allocate_bitmask,
    apply_token_bitmask_,
    draft_bitmask,
    spec_from_request,
    spec_from_structured_outputs,
    unpack_bitmask,
)
from specfleet.engine.structured_output.bitmask import apply_token_bitmask_reference_

VOCAB = 49152  # SmolLM2's config.vocab_size

SCHEMAS = {
    "enum_and_bounded_ints": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 12},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
        "additionalProperties": False,
    },
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "integer"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array_min_max_items": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4},
            "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["tags", "scores"],
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        },
        "required": ["id", "email"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": ["integer", "null"]}},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
}
# a valid instance per schema, the way the grammar prints it (", " and ": ")
INSTANCES = {
    "enum_and_bounded_ints": {"color": "green", "size": 11, "ok": True},
    "nested_objects": {"user": {"name": "Ada", "address": {"city": "London", "zip": 12345}}, "active": False},
    "array_min_max_items": {"tags": ["a", "c", "b"], "scores": [1.5, -2]},
    "string_patterns": {"id": "ABC-1234", "email": "ada@math.org"},
    "array_of_objects": [{"k": "x", "v": 1}, {"k": "yy", "v": None}],
}


@pytest.fixture(scope="module")
def tokenizer(bundled_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_path)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id], max_rollback_tokens=8)


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    return unpack_bitmask(bitmask[row : row + 1], VOCAB)[0].nonzero().flatten().tolist()


def random_walk(
    backend: GrammarBackend,
    tokenizer,
    spec: StructuredOutputSpec,
    seed: int,
    max_tokens: int = 1500,
    closers: list[int] | None = None,
) -> str:
    """Generate under the mask, each token uniform among the allowed ones, until the grammar ends.
    With `closers`, every other draw picks among the allowed closers instead (if any is allowed): an
    open-ended grammar then ends within the budget."""
    rng = random.Random(seed)
    matcher = backend.matcher(spec)
    bitmask = backend.allocate_bitmask(1)
    tokens: list[int] = []
    for _ in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask)
        closing = sorted(set(closers or ()) & set(allowed))
        token = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        assert matcher.accept_token(token), f"the mask allowed {token}, the matcher refused it"
        if token == tokenizer.eos_token_id:
            assert matcher.is_terminated()
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no end after {max_tokens} tokens: {tokenizer.decode(tokens)[:200]!r}")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- generation under the mask -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walk_under_a_json_schema_validates(backend, tokenizer, name, seed):
    schema = SCHEMAS[name]
    text = random_walk(backend, tokenizer, StructuredOutputSpec.json_schema(schema), seed)
    jsonschema.validate(json.loads(text), schema)


def test_random_walks_differ_by_seed(backend, tokenizer):
    """The walk really samples: different seeds give different valid outputs."""
    spec = StructuredOutputSpec.json_schema(SCHEMAS["nested_objects"])
    assert len({random_walk(backend, tokenizer, spec, seed) for seed in range(4)}) > 1


@pytest.mark.parametrize("seed", range(4))
def test_json_object_walk_is_an_object(backend, tokenizer, seed):
    # a schema-free object nests and runs on without bound under a uniform walk: lean on closers
    closers = [encode(tokenizer, c)[0] for c in ('"', "}", "]", "1", ", ", "null")] + [tokenizer.eos_token_id]
    text = random_walk(backend, tokenizer, StructuredOutputSpec.json_object(), seed, closers=closers)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(5))
def test_regex_walk_matches(backend, tokenizer, seed):
    pattern = r"[A-Z][a-z]{2,6} (19|20)[0-9]{2}-(0[1-9]|1[0-2])"
    text = random_walk(backend, tokenizer, StructuredOutputSpec.regex(pattern), seed)
    assert re.fullmatch(pattern, text), text


def test_choice_walk_picks_one(backend, tokenizer):
    choices = ["red", "green", "blue", 'dark "red"', "two\nlines"]
    seen = {random_walk(backend, tokenizer, StructuredOutputSpec.choice(choices), seed) for seed in range(12)}
    assert seen <= set(choices)
    assert len(seen) >= 3


def test_grammar_walk_matches(backend, tokenizer):
    grammar = 'root ::= expr\nexpr ::= term (("+" | "*") term){0,3}\nterm ::= [1-9] [0-9]{0,2} | "(" expr ")"'
    for seed in range(5):
        text = random_walk(backend, tokenizer, StructuredOutputSpec.grammar(grammar), seed)
        assert re.fullmatch(r"[0-9+*()]+", text), text
        assert eval(text) >= 0  # digits, +, *, parentheses only, checked above


def test_valid_instance_tokens_are_each_allowed(backend, tokenizer):
    """The instance the user expects is reachable: every token of it is in the mask when it comes."""
    for name, instance in INSTANCES.items():
        matcher = backend.matcher(StructuredOutputSpec.json_schema(SCHEMAS[name]))
        bitmask = backend.allocate_bitmask(1)
        for token in encode(tokenizer, json.dumps(instance)) + [tokenizer.eos_token_id]:
            matcher.fill_bitmask(bitmask, 0)
            assert token in allowed_ids(bitmask), (name, tokenizer.decode([token]))
            assert matcher.accept_token(token)
        assert matcher.is_terminated()


def test_terminated_matcher_allows_only_stop_tokens(backend, tokenizer):
    matcher = backend.matcher(StructuredOutputSpec.choice(["yes", "no"]))
    assert matcher.accept_tokens(encode(tokenizer, "yes"))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask) == [tokenizer.eos_token_id]
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask) == [tokenizer.eos_token_id]
    assert not matcher.accept_token(encode(tokenizer, "no")[0])


# -- matcher state: validate, accept, rollback --------------------------------------------------------


def test_rollback_restores_the_mask_and_the_path(backend, tokenizer):
    spec = StructuredOutputSpec.json_schema(SCHEMAS["nested_objects"])
    tokens = encode(tokenizer, json.dumps(INSTANCES["nested_objects"]))
    matcher = backend.matcher(spec)
    before, after = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
    assert matcher.accept_tokens(tokens[:3])
    matcher.fill_bitmask(before, 0)
    assert matcher.accept_tokens(tokens[3:9])
    matcher.fill_bitmask(after, 0)
    assert not torch.equal(before, after)
    matcher.rollback(6)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.accept_tokens(tokens[3:] + [tokenizer.eos_token_id]) and matcher.is_terminated()


def test_rollback_limits(backend, tokenizer):
    matcher = backend.matcher(StructuredOutputSpec.json_object())
    tokens = encode(tokenizer, '{"a": 1, "bb": [1, 2, 3], "c": "hello there"}')
    assert len(tokens) > 9
    with pytest.raises(ValueError, match="2 tokens: 0 accepted"):
        matcher.rollback(2)
    assert matcher.accept_tokens(tokens[:10])
    with pytest.raises(ValueError, match="max_rollback_tokens=8"):
        matcher.rollback(9)


def test_validate_and_accept_tokens(backend, tokenizer):
    spec = StructuredOutputSpec.json_schema(SCHEMAS["enum_and_bounded_ints"])
    good = encode(tokenizer, '{"color": "blue", "size": 3')
    bad = encode(tokenizer, '{"color": "pink"')
    matcher = backend.matcher(spec)
    assert matcher.validate_tokens(good) == len(good)
    prefix = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
    assert matcher.validate_tokens(bad) == prefix
    assert matcher.num_accepted == 0  # validation leaves the state where it was
    assert not matcher.accept_tokens(bad)  # all or nothing
    assert matcher.num_accepted == 0
    assert matcher.accept_tokens(good) and matcher.num_accepted == len(good)


# -- speculation: k + 1 rows, truncated at the first invalid draft ------------------------------------


def stepwise_rows(backend, spec, prefix: list[int], drafts: list[int]) -> torch.Tensor:
    """The masks a non-speculative engine would see: one fresh matcher advanced one token at a time."""
    matcher = backend.matcher(spec)
    assert matcher.accept_tokens(prefix)
    rows = backend.allocate_bitmask(len(drafts) + 1)
    for i, token in enumerate(drafts):
        matcher.fill_bitmask(rows, i)
        assert matcher.accept_token(token)
    matcher.fill_bitmask(rows, len(drafts))
    return rows


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_draft_rows_equal_one_token_at_a_time(backend, tokenizer, name):
    spec = StructuredOutputSpec.json_schema(SCHEMAS[name])
    tokens = encode(tokenizer, json.dumps(INSTANCES[name])) + [tokenizer.eos_token_id]
    k = 4
    matcher = backend.matcher(spec)
    out = backend.allocate_bitmask(k + 1)
    for pos in range(len(tokens)):
        drafts = tokens[pos : pos + k]
        num_valid, rows = draft_bitmask(matcher, drafts, VOCAB, out=out)
        assert num_valid == len(drafts)
        assert torch.equal(rows, stepwise_rows(backend, spec, tokens[:pos], drafts)), pos
        assert matcher.num_accepted == pos  # rolled back
        assert matcher.accept_token(tokens[pos])  # the engine accepts one token, the walk goes on
    assert matcher.is_terminated()


def test_drafts_truncate_at_the_first_forbidden_token(backend, tokenizer):
    spec = StructuredOutputSpec.json_schema(SCHEMAS["enum_and_bounded_ints"])
    tokens = encode(tokenizer, '{"color": "red", "size": 7, "ok": true}')
    matcher = backend.matcher(spec)
    assert matcher.accept_tokens(tokens[:2])
    before = backend.allocate_bitmask(1)
    matcher.fill_bitmask(before, 0)
    forbidden = encode(tokenizer, "}")[0]
    drafts = tokens[2:4] + [forbidden] + tokens[5:7]
    num_valid, rows = draft_bitmask(matcher, drafts, VOCAB)
    assert num_valid == 2 and rows.shape == (3, VOCAB // 32)
    assert torch.equal(rows, stepwise_rows(backend, spec, tokens[:2], drafts[:2]))
    assert forbidden not in allowed_ids(rows, 2)  # the target's masked p is 0 there: it would reject it
    after = backend.allocate_bitmask(1)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after) and matcher.num_accepted == 2


def test_draft_through_the_stop_token(backend, tokenizer):
    """A draft that completes the grammar and drafts EOS: EOS is valid, what follows it is not."""
    spec = StructuredOutputSpec.choice(["yes", "no"])
    yes = encode(tokenizer, "yes")
    eos = tokenizer.eos_token_id
    matcher = backend.matcher(spec)
    num_valid, rows = draft_bitmask(matcher, yes + [eos, eos], VOCAB)
    assert num_valid == len(yes) + 1
    assert allowed_ids(rows, len(yes)) == [eos] and allowed_ids(rows, len(yes) + 1) == [eos]
    assert matcher.num_accepted == 0 and not matcher.is_terminated()


def test_draft_bitmask_refuses_more_drafts_than_rollback(backend, tokenizer):
    matcher = backend.matcher(StructuredOutputSpec.json_object())
    with pytest.raises(ValueError, match="max_rollback_tokens=8"):
        draft_bitmask(matcher, [1] * 9, VOCAB)


# -- applying a mask to logits ------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1024, 1000])  # 1000: the last word is partly used (the reference path)
def test_apply_matches_the_reference_and_guards_dead_rows(vocab):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[0, :10], bitmask[0, 10:20], bitmask[2, 5:] = 0, -1, 0  # whole words masked and allowed
    bitmask[1] = 0  # a dead end
    indices = [4, 0, 2]
    got, want = logits.clone(), logits.clone()
    dead = apply_token_bitmask_(got, bitmask, indices)
    assert dead.tolist() == [False, True, False]
    live = bitmask.clone()
    live[1] = -1
    apply_token_bitmask_reference_(want, live, indices)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 1, 3, 5]], logits[[0, 1, 3, 5]])  # the dead row and unmasked rows untouched
    allowed = unpack_bitmask(bitmask[[0]], vocab)[0]
    assert torch.isinf(got[4][~allowed]).all() and torch.equal(got[4][allowed], logits[4][allowed])
    assert not got.softmax(dim=-1).isnan().any()
    assert torch.isinf(got[4, :320]).all() and torch.equal(got[4, 320:640], logits[4, 320:640])


def test_apply_without_indices_masks_row_by_row(backend, tokenizer):
    """Real masks from a walk, applied to a batch at once, equal the reference bit by bit."""
    spec = StructuredOutputSpec.json_schema(SCHEMAS["string_patterns"])
    tokens = encode(tokenizer, json.dumps(INSTANCES["string_patterns"]))
    matcher = backend.matcher(spec)
    masks = backend.allocate_bitmask(len(tokens))
    for row, token in enumerate(tokens):
        matcher.fill_bitmask(masks, row)
        assert matcher.accept_token(token)
    logits = torch.randn(len(tokens), VOCAB, generator=torch.Generator().manual_seed(1))
    got, want = logits.clone(), logits.clone()
    assert not apply_token_bitmask_(got, masks).any()
    apply_token_bitmask_reference_(want, masks)
    assert torch.equal(got, want)
    assert torch.equal(torch.isfinite(got), unpack_bitmask(masks, VOCAB))


def test_apply_checks_shapes():
    with pytest.raises(ValueError, match="need 2"):
        apply_token_bitmask_(torch.zeros(1, 64), allocate_bitmask(1, 128))
    with pytest.raises(ValueError, match="pass indices"):
        apply_token_bitmask_(torch.zeros(2, 64), allocate_bitmask(1, 64))


def test_masked_greedy_picks_the_best_allowed_token(backend, tokenizer):
    matcher = backend.matcher(StructuredOutputSpec.choice(["Paris", "London"]))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    logits[0, encode(tokenizer, "Berlin")[0]] = 10.0  # the model's favourite, forbidden
    london = encode(tokenizer, "London")[0]
    logits[0, london] = 1.0
    apply_token_bitmask_(logits, bitmask)
    assert logits.argmax().item() == london


# -- errors: typed, naming the problem ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            StructuredOutputSpec.json_schema({"type": "foo"}, "guided_json"),
            ["JSON schema", "guided_json", 'type "foo"'],
        ),
        (
            StructuredOutputSpec.json_schema({"type": "array", "minItems": 3, "maxItems": 1}),
            ["minItems is greater than maxItems: 3 > 1"],
        ),
        (StructuredOutputSpec.json_schema({"$ref": "#/$defs/missing"}), ["Cannot find field"]),
        (StructuredOutputSpec.json_schema({"type": "string", "pattern": "[a-"}), ["Unclosed '['"]),
        (
            StructuredOutputSpec.regex("(a|b", "guided_regex"),
            ["regular expression", "guided_regex", "not closed"],
        ),
        (
            StructuredOutputSpec.grammar("root ::= item", "structured_outputs.grammar"),
            ["EBNF grammar", "structured_outputs.grammar", 'Rule "item" is not defined'],
        ),
    ],
)
def test_uncompilable_specs_raise_a_typed_error(backend, spec, words):
    with pytest.raises(StructuredOutputError) as info:
        backend.compile(spec)
    message = str(info.value)
    for word in words:
        assert word in message
    assert "/project/cpp" not in message and ".cc:" not in message  # xgrammar's source location is noise
    assert info.value.param == spec.source
    assert isinstance(info.value, ValueError)  # the server's 400 path


def test_every_kind_compiles(backend):
    samples = {
        "json_object": StructuredOutputSpec.json_object(),
        "json_schema": StructuredOutputSpec.json_schema({"type": "integer"}),
        "regex": StructuredOutputSpec.regex("[0-9]+"),
        "choice": StructuredOutputSpec.choice(["a", "b"]),
        "grammar": StructuredOutputSpec.grammar('root ::= "x"'),
    }
    assert tuple(samples) == KINDS == backend.kinds
    for spec in samples.values():
        backend.compile(spec)


def test_compile_cache_is_keyed_by_spec(backend):
    a = StructuredOutputSpec.json_schema(
        {"type": "object", "properties": {"x": {"type": "integer"}}}, "guided_json"
    )
    b = StructuredOutputSpec.json_schema(
        '{"type": "object", "properties": {"x": {"type": "integer"}}}', "response_format"
    )
    assert a == b and hash(a) == hash(b)  # the field it came from is not part of the key
    assert backend.compile(a) is backend.compile(b)
    assert backend.compile(StructuredOutputSpec.json_schema({"type": "integer"})) is not backend.compile(a)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: StructuredOutputSpec.json_schema("{not json", "guided_json"),
            "guided_json is not valid JSON",
        ),
        (lambda: StructuredOutputSpec.json_schema([1, 2], "guided_json"), "must be a JSON object"),
        (lambda: StructuredOutputSpec.regex("", "guided_regex"), "guided_regex must be a regular expression"),
        (lambda: StructuredOutputSpec.choice([], "guided_choice"), "guided_choice must be a non-empty list"),
        (lambda: StructuredOutputSpec.choice(["a", 3], "guided_choice"), "non-empty strings only, got 3"),
        (lambda: StructuredOutputSpec("xml", "<a/>"), "unknown structured-output kind 'xml'"),
        (lambda: StructuredOutputSpec("json_object", "x"), "takes no value"),
    ],
)
def test_malformed_specs_raise(build, match):
    with pytest.raises(StructuredOutputError, match=match):
        build()


# -- request fields -----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputSpec.json_object()),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputSpec.json_schema(SCHEMA),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputSpec.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputSpec.json_schema(SCHEMA)),
        ({"guided_regex": "a+"}, StructuredOutputSpec.regex("a+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputSpec.choice(["x", "y"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputSpec.grammar('root ::= "a"')),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputSpec.regex("a+")),
        ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputSpec.choice(["x"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputSpec.grammar('root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputSpec.json_object()),
        ({"response_format": {"type": "text"}, "guided_regex": "a+"}, StructuredOutputSpec.regex("a+")),
    ],
)
def test_request_fields_to_spec(fields, want):
    assert spec_from_request(**fields) == want


def test_request_fields_keep_their_source_for_errors():
    spec = spec_from_request(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    )
    assert spec.source == "response_format.json_schema.schema"
    assert spec_from_request(structured_outputs={"regex": "a"}).source == "structured_outputs.regex"
    assert spec_from_request(guided_choice=["a"]).source == "guided_choice"


def test_request_fields_accept_pydantic_models():
    from pydantic import BaseModel, ConfigDict, Field

    class JsonSchema(BaseModel):
        model_config = ConfigDict(populate_by_name=True)
        name: str
        schema_: dict = Field(alias="schema")

    class ResponseFormat(BaseModel):
        type: str
        json_schema: JsonSchema | None = None

    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchema(name="x", schema=SCHEMA))
    assert spec_from_request(response_format=fmt) == StructuredOutputSpec.json_schema(SCHEMA)


@pytest.mark.parametrize(
    ("fields", "match", "param"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "got guided_json and guided_regex", "guided_regex"),
        (
            {
                "response_format": {"type": "json_object"},
                "guided_choice": ["a"],
                "structured_outputs": {"regex": "a"},
            },
            "got response_format, guided_choice and structured_outputs",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "regex": "a"}},
            "exactly one of .* got json and regex",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"backend": "xgrammar"}},
            "does not support backend",
            "structured_outputs.backend",
        ),
        ({"structured_outputs": {"json_object": "yes"}}, "must be true", "structured_outputs.json_object"),
        (
            {"response_format": {"type": "yaml"}},
            "type must be one of text, json_object, json_schema",
            "response_format.type",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "must be an object like",
            "response_format.json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "schema is required",
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": "no"},
                }
            },
            "strict must be a boolean",
            "response_format.json_schema.strict",
        ),
        (
            {"response_format": {"type": "json_object", "schema": SCHEMA}},
            "does not take schema",
            "response_format.schema",
        ),
        ({"response_format": "json"}, "must be an object with a `type`", "response_format"),
        ({"guided_choice": "a"}, "guided_choice must be a non-empty list", "guided_choice"),
    ],
)
def test_bad_request_fields_name_the_field(fields, match, param):
    with pytest.raises(StructuredOutputError, match=match) as info:
        spec_from_request(**fields)
    assert info.value.param == param


def test_offline_structured_outputs_passes_a_spec_through():
    spec = StructuredOutputSpec.regex("a+")
    assert spec_from_structured_outputs(spec) is spec
    assert spec_from_structured_outputs({"regex": None}) is None
