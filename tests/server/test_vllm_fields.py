"""vLLM's sampling fields over HTTP with the official openai client (extra_body where OpenAI has no field),
each checked against the offline engine on the same model: the server maps them, it does not approximate."""

from __future__ import annotations

from typing import Any

import pytest
from specfleet.engine import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "List three colors: red,"


def _offline(engine: Any, params: SamplingParams, prompt: str = PROMPT):
    """The same request through an in-process engine with the server's settings."""
    rid = f"offline-{id(params)}"
    engine.add_request(rid, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_extra_body_sampling_fields_match_the_engine(
    client: Any, model_name: str, offline_engine: Any
) -> None:
    extra = {"repetition_penalty": 1.4, "min_p": 0.05, "bad_words": ["blue"], "top_k": 20}
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra
    )
    offline = _offline(
        offline_engine,
        SamplingParams(
            temperature=0, max_tokens=12, repetition_penalty=1.4, min_p=0.05, bad_words=["blue"], top_k=20
        ),
    )
    assert resp.choices[0].text == offline.outputs[0].text
    assert "blue" not in resp.choices[0].text


def test_logit_bias_seed_n_and_stop(client: Any, model_name: str) -> None:
    forced = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=1.0, logit_bias={"28": 100}
    )
    assert forced.choices[0].text == "," * 4  # token 28 is ","
    seeded = [
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11, n=2, stop=["\n"]
        )
        for _ in range(2)
    ]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert all("\n" not in c.text for c in seeded[0].choices)


def test_echo_with_logprobs_and_prompt_logprobs(client: Any, model_name: str) -> None:
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = resp.choices[0]
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    lps = choice.logprobs
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None  # the first prompt token has none
    assert all(lp is not None and lp <= 0 for lp in lps.token_logprobs[1:])
    assert "".join(lps.tokens) == choice.text
    streamed = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
    ).http_response.json()
    prompt_lps = raw["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and all(entry for entry in prompt_lps[1:])
    first = next(iter(prompt_lps[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}


def test_chat_top_logprobs_and_prompt_logprobs(client: Any, model_name: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"prompt_logprobs": 0},
    ).http_response.json()
    content = raw["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert raw["prompt_logprobs"][0] is None and len(raw["prompt_logprobs"]) == raw["usage"]["prompt_tokens"]
