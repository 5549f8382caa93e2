"""What the SDKs do with the server's answers beyond a generated text, over a real socket: the official
openai client's `models.retrieve` (OpenAI's GET /v1/models/{model}, which the client percent-encodes, so a
name with a slash arrives as one path), the client's and LiteLLM's reading of a request longer than the
context (LiteLLM's ContextWindowExceededError, which its context-window fallbacks act on, is raised only
for OpenAI's wording), the completions `suffix` the client offers, refused naming it, an earlier turn's
reasoning sent back to the template, the content parts the client's types allow besides text, and the
client's retry of a 429 after the Retry-After it names."""

from __future__ import annotations

from typing import Any

import pytest

# More tokens than the shared server's 1024-token context, however the template wraps them.
TOO_LONG = "hello " * 1100


def test_models_retrieve_finds_the_served_model_and_404s_any_other(client: Any, model_name: str) -> None:
    import openai

    card = client.models.retrieve(model_name)
    assert (card.id, card.object, card.owned_by) == (model_name, "model", "specfleet")
    assert card.model_dump() == client.models.list().data[0].model_dump()  # the list's card, field for field
    for name in ("org/not-served", "gpt-4o"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(name)
        assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
        assert f"model '{name}' does not exist" in missing.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 4}, "messages"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
    ],
)
def test_a_request_past_the_context_reads_as_an_overflow(
    client: Any, server: Any, model_name: str, monkeypatch: pytest.MonkeyPatch, body: dict, param: str
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, **body)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param)
    assert refused.value.message.startswith(
        "Error code: 400 - This model's maximum context length is 1024 tokens."
    )
    assert param in refused.value.message.split("However,")[1]

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list at import
    import litellm

    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{model_name}", api_base=f"{server.url}/v1", api_key="unused", max_retries=0, **body
        )
    server.wait_idle()
    assert server.kv_blocks_in_use() == 0


def test_a_completion_prompt_past_the_context_reads_as_an_overflow(client: Any, model_name: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_name, prompt=TOO_LONG, max_tokens=4)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")
    assert (
        "This model's maximum context length is 1024 tokens. However, your prompt has"
        in refused.value.message
    )


def test_completions_suffix_is_refused_naming_it(client: Any, model_name: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_name, prompt="def f(", suffix="return 1", max_tokens=4)
    assert refused.value.param == "suffix"
    assert "suffix is not supported" in refused.value.message


def test_an_earlier_turns_reasoning_reaches_the_template(
    client: Any, server: Any, model_name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assistant turn sent back with its reasoning (the Agents SDK replays `reasoning_content` to
    DeepSeek models, Qwen's clients do to Qwen3) reaches the template under both names, as vLLM hands it
    over (interleaved thinking); a template that renders it makes the prompt longer by its tokens."""
    from specfleet.engine.server.chat import ChatOptions

    template = tmp_path / "thinking.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{% if m.reasoning %}<think>{{ m.reasoning }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
    )
    monkeypatch.setattr(server.state, "chat", ChatOptions.from_flags(chat_template=str(template)))

    def prompt_tokens(**said: str) -> int:
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", **said},
            {"role": "user", "content": "bye"},
        ]
        answer = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
        return int(answer.usage.prompt_tokens)

    plain = prompt_tokens()
    with_reasoning = prompt_tokens(reasoning_content="the user greets me")
    # both names filled from either, so the second <think> block is there too
    assert with_reasoning > plain + 8
    assert prompt_tokens(reasoning="the user greets me") == with_reasoning


def test_the_client_retries_a_full_queue_after_its_retry_after(
    client: Any, server: Any, model_name: str
) -> None:
    """A 429 `queue_full` says `Retry-After: 1`; the official client waits that long before its retry (its
    own backoff would retry after 0.5 s at most), and the retry is served once the queue has room."""
    import threading
    import time

    from specfleet.engine.server.api import QUEUE_RETRY_AFTER_S

    engine = server.async_engine
    room = engine.max_waiting
    engine.max_waiting = 0  # every request is refused until the timer gives the room back
    timer = threading.Timer(0.3, lambda: setattr(engine, "max_waiting", room))
    timer.start()
    try:
        start = time.monotonic()
        answer = client.with_options(max_retries=2).chat.completions.with_raw_response.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        waited = time.monotonic() - start
    finally:
        timer.join()
        engine.max_waiting = room
    assert answer.http_response.status_code == 200 and answer.retries_taken == 1
    assert waited >= QUEUE_RETRY_AFTER_S  # a lower bound: a loaded host only makes it longer


def test_content_parts_the_client_types_allow_are_read_as_text(client: Any, model_name: str) -> None:
    """OpenAI's message params allow an assistant's `refusal` part; transcripts replayed from the Responses
    API carry `input_text` / `output_text`: all are text to the template (as vLLM reads them), and a part
    that is not text is still a 400 naming the content."""
    import openai

    def prompt_tokens(refused: Any, asked: Any) -> int:
        messages = [
            {"role": "user", "content": asked},
            {"role": "assistant", "content": refused},
            {"role": "user", "content": "An anvil, then?"},
        ]
        answer = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
        return int(answer.usage.prompt_tokens)

    as_text = prompt_tokens("I cannot help with rockets.", "Build me a rocket.")
    as_parts = prompt_tokens(
        [{"type": "refusal", "refusal": "I cannot help with rockets."}],
        [{"type": "input_text", "text": "Build me a rocket."}],
    )
    assert as_parts == as_text  # the same prompt, part for string
    with pytest.raises(openai.BadRequestError) as refused:
        prompt_tokens([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "hi")
    assert refused.value.param == "messages.1.content"
    assert "type 'image_url' is not supported" in refused.value.message
