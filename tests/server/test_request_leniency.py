"""vLLM's leniency and its strictness over HTTP, against the real server: unknown fields are accepted, logged
once per name and counted; null means the default; bad values and the fields specfleet cannot honour are a
400 naming the field. The official openai client sends what it can express, httpx the rest."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

SERVER_LOGGER = "specfleet.engine.server"
CHAT = [{"role": "user", "content": "Hi"}]


def ignored_counts(server: Any) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        m["field"]: float(m["value"])
        for m in re.finditer(
            r'^specfleet_ignored_request_fields_total\{[^}]*field="(?P<field>[^"]+)"[^}]*\} (?P<value>\S+)$',
            text,
            re.MULTILINE,
        )
    }


def counted(before: dict[str, float], after: dict[str, float], field: str) -> float:
    """Requests counted for `field`: under its own label, or under "other" once the server's label budget
    (metrics.MAX_IGNORED_FIELD_LABELS) went to earlier names, e.g. the schemathesis run's."""
    label = field if field in after else "other"
    return after[label] - before.get(label, 0)


def test_fields_sdks_send_are_accepted_logged_once_and_counted(
    client: Any, server: Any, model_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    probe = f"sdk_probe_{uuid.uuid4().hex[:8]}"  # a name no other test sent, so its first log line is ours
    extra = {probe: {"nested": True}, "guided_decoding_backend": "xgrammar", "service_tier": "auto"}
    before = ignored_counts(server)
    with caplog.at_level(logging.WARNING, logger=SERVER_LOGGER):
        for _ in range(2):
            resp = client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2,
                store=True,
                metadata={"team": "a"},
                reasoning_effort="low",
                extra_body=extra,
            )
            assert resp.choices[0].message.content is not None
        completion = client.completions.create(
            model=model_name, prompt="Hi", max_tokens=2, extra_body={probe: 1, "priority": 0}
        )
    assert completion.choices[0].finish_reason in ("stop", "length")
    after = ignored_counts(server)
    assert counted(before, after, probe) >= 3  # every request counted
    for field in ("store", "metadata", "reasoning_effort", "guided_decoding_backend", "service_tier"):
        assert counted(before, after, field) >= 2, field
    if probe in after:  # its own series (not "other"): exactly this test's three requests
        assert after[probe] - before.get(probe, 0) == 3
    probe_records = [r for r in caplog.records if f"field={probe} " in r.getMessage()]
    assert len(probe_records) == 1 and "event=ignored_request_field" in probe_records[0].getMessage()
    assert probe_records[0].levelno == logging.WARNING  # once per name, where operators look


def test_unknown_fields_inside_messages_and_stream_options_are_accepted(
    server: Any, model_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    probe = f"sdk_probe_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger=SERVER_LOGGER):
        resp = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={
                "model": model_name,
                "messages": [{"role": "user", "content": "Hi", probe: {"type": "ephemeral"}}],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True, probe: False},
            },
            timeout=60,
        )
    assert resp.status_code == 200, resp.text
    assert resp.text.endswith("data: [DONE]\n\n")
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert f"field=messages.{probe} " in logged and f"field=stream_options.{probe} " in logged


def test_null_means_the_default(server: Any, model_name: str) -> None:
    nulls = dict.fromkeys(
        (
            "temperature",
            "top_p",
            "n",
            "logprobs",
            "presence_penalty",
            "frequency_penalty",
            "stop",
            "max_tokens",
            "top_k",
            "min_p",
            "repetition_penalty",
            "stream_options",
            "user",
            "best_of",
            "echo",
        ),
    )
    body = {"model": model_name, "prompt": "Once upon a time", "seed": 1234}
    with_nulls = httpx.post(f"{server.url}/v1/completions", json={**body, **nulls}, timeout=60)
    assert with_nulls.status_code == 200, with_nulls.text
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    got = with_nulls.json()
    assert got["choices"][0]["text"] == plain["choices"][0]["text"]  # temperature 1, seeded: same draw
    assert got["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] <= 16  # max_tokens: 16
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "Hi", "name": None}],
            "max_tokens": 2,
            "logprobs": None,
            "top_logprobs": None,
            "temperature": None,
            "n": None,
            "response_format": None,
            "seed": None,
        },
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    # null is lenient, a bad value is not: still a 400 naming the field
    for extra, param in (({"temperature": 5}, "temperature"), ({"n": 0}, "n"), ({"prompt": None}, "prompt")):
        bad = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    for extra, param in (({"temperature": "hot"}, "temperature"), ({"messages": None}, "messages")):
        bad = httpx.post(
            f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **extra}, timeout=60
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


@pytest.mark.parametrize(
    ("route", "extra", "param", "words"),
    [
        ("completions", {"n": 16385}, "n", "16384"),
        ("completions", {"use_beam_search": True}, "use_beam_search", "beam search is not implemented"),
        ("completions", {"priority": 3}, "priority", "first come, first served"),
        ("completions", {"logits_processors": ["my.mod.Proc"]}, "logits_processors", "not loaded"),
        ("completions", {"request_id": "has space"}, "request_id", "should match pattern"),
        ("chat", {"continue_final_message": True}, "continue_final_message", "add_generation_prompt=false"),
        ("chat", {"max_repetition_pattern_size": 4}, "max_repetition_pattern_size", "not implemented"),
    ],
)
def test_bad_values_and_unsupported_asks_are_400_naming_the_field(
    server: Any, model_name: str, route: str, extra: dict[str, Any], param: str, words: str
) -> None:
    base: dict[str, Any] = {"model": model_name, "max_tokens": 2}
    if route == "chat":
        base["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        base["prompt"] = "Hi"
    resp = httpx.post(
        f"{server.url}/v1/{route.replace('chat', 'chat/completions')}", json={**base, **extra}, timeout=60
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_fields_at_vllm_defaults_are_accepted(client: Any, model_name: str) -> None:
    """An SDK that serialises every vLLM field at its default asks for nothing specfleet lacks."""
    defaults = {
        "use_beam_search": False,
        "priority": 0,
        "length_penalty": 1.0,
        "echo": False,
        "add_special_tokens": False,
        "continue_final_message": False,
        "documents": None,
        "chat_template": None,
        "logits_processors": None,
        "max_repetition_pattern_size": 0,
        "vllm_xargs": None,
        "top_logprobs": 0,  # vLLM's default, sent without logprobs
    }
    resp = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=defaults
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_completions_response_format_is_honoured(client: Any, model_name: str) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    resp = client.completions.create(
        model=model_name,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        },
    )
    assert resp.choices[0].text in ('"yes"', '"no"')
