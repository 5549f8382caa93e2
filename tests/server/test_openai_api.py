"""The OpenAI routes driven by the official openai client over a real socket."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name one fruit."}]


def test_models_lists_the_served_model(client: Any, model_name: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_completion_non_streaming(client: Any, model_name: str) -> None:
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.model == model_name
    assert len(resp.choices) == 1 and resp.choices[0].text
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.completion_tokens <= 5 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_streaming_matches_non_streaming(client: Any, model_name: str) -> None:
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(server: Any, model_name: str) -> None:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_chat_non_streaming_and_streaming_agree(client: Any, model_name: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6, temperature=0)
    assert full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=CHAT, max_completion_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_2_returns_two_choices(client: Any, model_name: str) -> None:
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    stream = list(
        client.chat.completions.create(
            model=model_name, messages=CHAT, max_tokens=3, n=2, temperature=1.0, seed=3, stream=True
        )
    )
    indices = {choice.index for chunk in stream for choice in chunk.choices}
    assert indices == {0, 1}


def test_stop_string_cuts_the_text(client: Any, model_name: str) -> None:
    base = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    text = base.choices[0].text
    assert len(text.strip()) >= 3, text
    stop = text.strip()[1:3]  # a string inside the greedy continuation, likely spanning token boundaries
    cut = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_seeded_sampling_is_reproducible(client: Any, model_name: str) -> None:
    kwargs = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 1234,
    }
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_logprobs_completion_and_chat(client: Any, model_name: str) -> None:
    resp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # greedy: the chosen token is the most likely one
    assert all(c.logprob == pytest.approx(max(t.logprob for t in c.top_logprobs)) for c in content)


def test_greedy_server_output_equals_offline_engine(client: Any, model_name: str) -> None:
    from specfleet.engine import Engine, EngineConfig, SamplingParams

    prompts = ["def fibonacci(n):", "The quick brown fox"]
    served = [
        client.completions.create(model=model_name, prompt=p, max_tokens=8, temperature=0).choices[0]
        for p in prompts
    ]
    offline = Engine(
        EngineConfig(model="bundled://smollm2-135m-instruct", max_model_len=1024, kv_cache_gib=0.1)
    )
    for i, prompt in enumerate(prompts):
        offline.add_request(f"offline-{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
    finals: dict[str, Any] = {}
    while offline.has_unfinished_requests():
        for out in offline.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    for i, choice in enumerate(served):
        assert choice.text == finals[f"offline-{i}"].text, prompts[i]
        assert choice.finish_reason == finals[f"offline-{i}"].finish_reason


def test_batch_of_prompts_in_one_request(client: Any, model_name: str) -> None:
    resp = client.completions.create(
        model=model_name, prompt=["Hello", "Goodbye"], max_tokens=2, temperature=0
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]


def test_health_and_ready(server: Any) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_multibyte_text_streams_intact(client: Any, model_name: str) -> None:
    messages = [{"role": "user", "content": "Écris « café » et 東京 puis un emoji 🙂 :"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=12, temperature=0)
    chunks = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert "\ufffd" not in streamed  # no half-decoded UTF-8 sequences reach the client


def test_continuous_usage_stats_count_up(client: Any, model_name: str) -> None:
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage.prompt_tokens > 0 for c in chunks)
