"""The engine's half of a resumed stream over HTTP (engine/server/resume.py): token ids on streamed choices
only for the router's header, a continuation from `resume_token_ids` that reads as the rest of the
undisturbed stream (on the shared server, which speculates with n-grams), and 400s naming the field for
what cannot be resumed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

HEADER = {"x-specfleet-token-ids": "1"}
BODY = {
    "prompt": "The capital of France is",
    "max_tokens": 24,
    "temperature": 0.9,
    "seed": 17,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def read(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, list[int] | None, dict]:
    text, ids, usage = "", None, {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["text"]
                if "token_ids" in choice:
                    ids = (ids or []) + choice["token_ids"]
    return text, ids, usage


def test_a_continuation_reads_as_the_rest_of_the_stream(server: Any):
    plain_text, plain_ids, _ = read(server.url, BODY, {})
    assert plain_ids is None  # no token ids without the router's header
    text, ids, usage = read(server.url, BODY, HEADER)
    assert text == plain_text and ids is not None and len(ids) == usage["completion_tokens"] == 24
    for cut in (1, 12):
        rest, rest_ids, rest_usage = read(server.url, {**BODY, "resume_token_ids": ids[:cut]}, HEADER)
        assert ids[:cut] + (rest_ids or []) == ids
        assert text.endswith(rest) and len(rest) < len(text)
        assert (rest_usage["prompt_tokens"], rest_usage["completion_tokens"]) == (usage["prompt_tokens"], 24)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stream": False, "stream_options": None}, "resume_token_ids needs stream=true"),
        ({"n": 2}, "this request sets n"),
        ({"echo": True}, "resume_token_ids needs one prompt and echo=false"),
        ({"max_tokens": 2}, "max_tokens=2 leaves none to generate"),
    ],
)
def test_what_cannot_be_resumed_is_a_400_naming_the_field(server: Any, changes: dict[str, Any], message: str):
    body = {k: v for k, v in {**BODY, **changes, "resume_token_ids": [5, 6]}.items() if v is not None}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "resume_token_ids" and message in error["message"]
