"""Structured outputs over HTTP with the official openai client (prototype integration): every answer
parses and validates with jsonschema, at temperature 0 and 0.9, in each request spelling."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

pytestmark = pytest.mark.slow

SCHEMAS = {
    "enum_and_bounded_int": {
        "type": "object",
        "properties": {
            "fruit": {"enum": ["apple", "banana", "cherry"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["fruit", "count"],
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
            }
        },
        "required": ["person"],
    },
    "array_min_max_items": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["code"],
    },
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema_validates(
    client: Any, model_name: str, name: str, temperature: float
) -> None:
    schema = SCHEMAS[name]
    resp = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        temperature=temperature,
        seed=7,
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_extra_body_spellings(client: Any, model_name: str) -> None:
    resp = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # an open object may run past max_tokens; what came out is still a JSON object's start
        assert resp.choices[0].message.content.startswith("{")
    schema = SCHEMAS["enum_and_bounded_int"]
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        out = client.completions.create(
            model=model_name, prompt="JSON:", max_tokens=40, temperature=0.9, seed=1, extra_body=extra
        )
        jsonschema.validate(json.loads(out.choices[0].text), schema)
    out = client.completions.create(
        model=model_name,
        prompt="Pick:",
        max_tokens=10,
        temperature=0.9,
        extra_body={"guided_choice": ["left", "right"]},
        n=2,
    )
    assert {c.text for c in out.choices} <= {"left", "right"}
    out = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0.9,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text


def test_bad_schema_is_a_400_naming_the_field(client: Any, model_name: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=5,
            extra_body={"guided_json": {"type": "array", "minItems": 3, "maxItems": 1}},
        )
    assert "minItems is greater than maxItems" in str(info.value)
    assert info.value.body["param"] == "guided_json"
