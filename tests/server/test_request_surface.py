"""The rest of vLLM's request surface, against the real server: `stop_reason` in chat, request ids (body,
X-Request-Id header, response header, log line), /tokenize, /detokenize, /version, and vLLM's limits for
`n`, `seed` and `logprobs=-1`."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Write the numbers from one to ten in words."}]


def _chat(server: Any, model_name: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model_name, "messages": CHAT, "temperature": 0, **body},
        timeout=60,
    )


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_chat_stop_reason_names_the_stop_string_or_is_null(client: Any, server: Any, model_name: str) -> None:
    free = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0)
    text = free.choices[0].message.content
    assert len(text) >= 6, text
    stop = text[4:6]  # two characters the greedy answer reaches after four others
    raw = _chat(server, model_name, max_tokens=12, stop=[stop]).json()["choices"][0]
    assert raw["finish_reason"] == "stop" and raw["stop_reason"] == stop, raw
    assert raw["message"]["content"] == text[: text.index(stop)]
    cut = _chat(server, model_name, max_tokens=2).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["stop_reason"] is None
    streamed = _sse(_chat(server, model_name, max_tokens=12, stop=[stop], stream=True).text)
    last = [c["choices"][0] for c in streamed if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", stop)]


def test_request_ids_from_header_body_or_generated(
    client: Any, server: Any, model_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="specfleet.engine.server"):
        by_header = client.chat.completions.with_raw_response.create(
            model=model_name, messages=CHAT, max_tokens=1, extra_headers={"X-Request-Id": "trace-7f3a"}
        )
    assert by_header.headers["x-request-id"] == "trace-7f3a"
    assert by_header.parse().id == "chatcmpl-trace-7f3a"
    assert any("request_id=chatcmpl-trace-7f3a " in r.getMessage() for r in caplog.records)

    by_body = client.completions.with_raw_response.create(
        model=model_name, prompt="Hi", max_tokens=1, extra_body={"request_id": "body-42"}
    )
    assert (by_body.headers["x-request-id"], by_body.parse().id) == ("body-42", "cmpl-body-42")

    both = client.completions.with_raw_response.create(
        model=model_name,
        prompt="Hi",
        max_tokens=1,
        extra_body={"request_id": "body-43"},
        extra_headers={"X-Request-Id": "header-43"},
    )
    assert (both.headers["x-request-id"], both.parse().id) == ("header-43", "cmpl-header-43")  # as vLLM

    generated = [
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}) for _ in "ab"
    ]
    ids = [r.headers["x-request-id"] for r in generated]
    assert ids[0] != ids[1] and [r.json()["id"] for r in generated] == [f"cmpl-{i}" for i in ids]
    error = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "Hi", "n": 0}, headers={"X-Request-Id": "e1"}
    )
    assert error.status_code == 400 and error.headers["x-request-id"] == "e1"
    spaced = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "Hi"}, headers={"X-Request-Id": "a b"}
    )
    assert spaced.status_code == 400 and spaced.json()["error"]["param"] == "X-Request-Id"


def test_a_request_id_in_flight_is_refused_naming_request_id(server: Any, model_name: str) -> None:
    # 100 tokens take the CPU engine seconds (30-80 ms each): the first is still running when the second comes
    body = {"model": model_name, "prompt": "Count:", "max_tokens": 100, "ignore_eos": True}
    headers = {"X-Request-Id": "busy-id"}
    started = threading.Event()
    lines: list[str] = []

    def first() -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**body, "stream": True},
            headers=headers,
            timeout=120,
        ) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=first)
    reader.start()
    assert started.wait(60)
    again = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
    reader.join(120)
    assert again.status_code == 400, again.text
    assert again.json()["error"]["param"] == "request_id" and "busy-id" in again.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(
        lines
    )  # the first is untouched
    after = httpx.post(
        f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, headers=headers, timeout=60
    )
    assert after.status_code == 200  # the id is free again once the first finished


def test_tokenize_detokenize_and_version(server: Any, model_name: str) -> None:
    tokenizer = server.state.tokenizer
    url = server.url
    plain = httpx.post(
        f"{url}/tokenize", json={"model": model_name, "prompt": "Hello world", "return_token_strs": True}
    )
    assert plain.status_code == 200, plain.text
    got = plain.json()
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert got == {
        "count": len(ids),
        "max_model_len": server.state.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == list(server.engine.apply_chat_template(CHAT)) and chat["token_strs"] is None
    served = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]  # what the chat route computes on
    back = httpx.post(f"{url}/detokenize", json={"model": model_name, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    missing = httpx.post(f"{url}/tokenize", json={"promt": "typo"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    wrong_model = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"})
    assert wrong_model.status_code == 404
    version = httpx.get(f"{url}/version")
    assert version.status_code == 200 and version.json()["version"].count(".") >= 1


def test_n_above_sixteen_and_negative_seeds(client: Any, model_name: str) -> None:
    many = client.completions.create(
        model=model_name, prompt="Pick a color:", max_tokens=1, n=20, temperature=1.0
    )
    assert sorted(c.index for c in many.choices) == list(range(20))
    draws = [
        client.completions.create(
            model=model_name, prompt="Pick a color:", max_tokens=6, seed=-9, temperature=1.0
        )
        for _ in range(2)
    ]
    assert draws[0].choices[0].text == draws[1].choices[0].text  # a negative seed seeds as any other


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
        ("completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ],
)
def test_logprobs_minus_one_is_the_whole_vocabulary_and_over_the_limit(
    server: Any, route: str, body: dict[str, Any], param: str
) -> None:
    resp = httpx.post(f"{server.url}/v1/{route}", json={**body, "max_tokens": 1}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    assert (
        f"requested logprobs of {server.state.vocab_size}" in error["message"]
        and "max allowed: 20" in error["message"]
    )


def test_scoring_echo_with_max_tokens_zero_answers_the_prompt_logprobs(
    client: Any, server: Any, model_name: str
) -> None:
    prompt = "The capital of France is Paris."
    scored = client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["count"]
    assert choice.text == prompt and "".join(choice.logprobs.tokens) == prompt
    lps = choice.logprobs.token_logprobs
    assert len(lps) == count and lps[0] is None and all(lp is not None and lp <= 0 for lp in lps[1:])
    generated = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    assert generated.choices[0].logprobs.token_logprobs[:count] == pytest.approx(lps, abs=1e-4)
    streamed = list(
        client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "echo" in refused.json()["error"]["message"]


def test_return_token_ids_on_non_streamed_responses(server: Any, model_name: str) -> None:
    url = server.url
    prompt = "Name a fruit:"
    raw = httpx.post(
        f"{url}/v1/completions",
        json={"model": model_name, "prompt": prompt, "max_tokens": 4, "return_token_ids": True},
        timeout=60,
    ).json()
    choice = raw["choices"][0]
    assert (
        choice["prompt_token_ids"] == httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    )
    assert len(choice["token_ids"]) == raw["usage"]["completion_tokens"]
    assert (
        httpx.post(f"{url}/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
        == choice["text"]
    )
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 3, "temperature": 0, "return_token_ids": True},
        timeout=60,
    ).json()
    assert chat["prompt_token_ids"] == httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0]  # only when asked, as vLLM
    streamed = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "stream": True, "return_token_ids": True},
        timeout=60,
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_token_ids"
