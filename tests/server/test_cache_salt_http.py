"""cache_salt over HTTP with the official client: a salted prompt's cached blocks serve only the same salt,
as `usage.prompt_tokens_details.cached_tokens` shows; a salt that is not a non-empty string is a 400."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def _cached_tokens(client: Any, model: str, prompt: str, salt: str | None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
    )
    return answer.usage.prompt_tokens_details.cached_tokens


def test_only_the_same_salt_reuses_a_salted_prefix(client: Any, model_name: str) -> None:
    prompt = f"Tenant notes {uuid.uuid4()}. " + "The quarterly report lists revenue by region. " * 12
    first = _cached_tokens(client, model_name, prompt, "tenant-a")
    other_salt = _cached_tokens(client, model_name, prompt, "tenant-b")
    unsalted = _cached_tokens(client, model_name, prompt, None)
    same_salt = _cached_tokens(client, model_name, prompt, "tenant-a")
    assert (first, other_salt, unsalted) == (0, 0, 0)
    assert same_salt >= 64, same_salt  # the prompt's ~100 tokens hold several full 16-token blocks


def test_the_same_salt_hits_in_chat_too(client: Any, model_name: str) -> None:
    messages = [{"role": "user", "content": f"{uuid.uuid4()} " + "Summarise the report by region. " * 12}]

    def cached(salt: str) -> int:
        answer = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("x") == 0
    assert cached("y") == 0
    assert cached("x") >= 64


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(server: Any, model_name: str, salt) -> None:
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 1, "cache_salt": salt}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"


def test_a_null_salt_is_no_salt(client: Any, model_name: str) -> None:
    prompt = f"{uuid.uuid4()} " + "Shared system prompt for every tenant. " * 12
    _cached_tokens(client, model_name, prompt, None)
    with pytest.raises(openai.BadRequestError):
        _cached_tokens(client, model_name, prompt, "")
    answer = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=1, extra_body={"cache_salt": None}
    )
    assert answer.usage.prompt_tokens_details.cached_tokens >= 64
