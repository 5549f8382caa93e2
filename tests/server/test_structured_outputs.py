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


def _strict_json(text: str) -> Any:
    """json.loads that refuses -Infinity, Infinity and NaN (not JSON: a strict client fails on them)."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("extra", [{"guided_choice": ["yes", "no"]}, {"guided_regex": "[0-9]{2}"}])
def test_structured_logprobs_are_finite_json(server: Any, model_name: str, extra: dict) -> None:
    import httpx

    body = {
        "model": model_name,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        **extra,
    }
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    content = _strict_json(resp.text)["choices"][0]["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 5 for entry in content)
    values = [entry["logprob"] for entry in content]
    values += [top["logprob"] for entry in content for top in entry["top_logprobs"]]
    assert all(-9999.0 <= v <= 0.0 for v in values), values
    streamed = []
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as sse:
        assert sse.status_code == 200
        for line in sse.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = _strict_json(line.removeprefix("data: "))
                for choice in chunk["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-3)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex"),
        ({"guided_regex": r"[^\s\S]"}, "guided_regex"),
    ],
)
def test_a_grammar_that_matches_nothing_is_a_400(
    client: Any, model_name: str, extra: dict, param: str
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert "matches no output" in str(info.value)
    assert info.value.body["param"] == param
