"""The chat template controls, as vLLM's: `add_generation_prompt`, `continue_final_message`, a request's own
`chat_template` (behind --trust-request-chat-template), `documents`, `add_special_tokens` and chat `echo`,
against the real server, through the official client's `extra_body` and /tokenize with messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from specfleet.engine.server.chat import ChatOptions

QUESTION = [{"role": "user", "content": "Count to ten."}]
STARTED = "One, two, three,"  # the assistant's answer so far, for the model to continue
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
# Renders the documents before the conversation, so a test can read them in the prompt.
DOC_TEMPLATE = (
    "{% for d in documents or [] %}<doc {{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tokenize(server: Any, **body: Any) -> list[int]:
    resp = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


@pytest.fixture
def trusting_server(server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The shared server started with --trust-request-chat-template."""
    monkeypatch.setattr(server.state, "chat", ChatOptions.from_flags(trust_request_chat_template=True))
    yield server


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(
    server: Any, client: Any, model_name: str
) -> None:
    opened = tokenize(server, messages=QUESTION)
    unopened = tokenize(server, messages=QUESTION, add_generation_prompt=False)
    tokenizer = server.state.tokenizer
    expected = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=False, tokenize=False)
    assert unopened == tokenizer.encode(expected, add_special_tokens=False)
    assert opened[: len(unopened)] == unopened and len(opened) > len(unopened)
    assert "assistant" in tokenizer.decode(opened[len(unopened) :])  # the turn the default opens
    resp = client.chat.completions.create(
        model=model_name,
        messages=QUESTION,
        max_tokens=1,
        extra_body={"add_generation_prompt": False},
    )
    assert resp.usage.prompt_tokens == len(unopened)


def test_continue_final_message_continues_the_assistants_text(
    server: Any, client: Any, model_name: str
) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": STARTED}]
    prompt = tokenize(server, messages=messages, **CONTINUE)
    text = server.state.tokenizer.decode(prompt)
    assert text.endswith(STARTED)  # no end of turn after the message, no new turn opened
    closed = tokenize(server, messages=messages, add_generation_prompt=False)
    assert closed[: len(prompt)] == prompt and len(closed) > len(prompt)  # the end of turn it left out
    chat = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=6, temperature=0, extra_body=CONTINUE
    )
    assert chat.usage.prompt_tokens == len(prompt)
    # the same continuation as the raw prompt's: the model writes on from the assistant's last word
    raw = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == raw.choices[0].text != ""


def test_echo_puts_the_continued_message_before_the_answer(client: Any, model_name: str) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": STARTED}]
    ask = {"model": model_name, "messages": messages, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**ask, extra_body=CONTINUE).choices[0].message.content
    echoed = client.chat.completions.create(**ask, extra_body={**CONTINUE, "echo": True})
    assert echoed.choices[0].message.content == STARTED + plain
    stream = client.chat.completions.create(**ask, stream=True, extra_body={**CONTINUE, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == STARTED + plain
    # the last message is the user's and the answer is the assistant's: nothing to echo (as vLLM)
    asked = {**ask, "messages": QUESTION}
    alone = client.chat.completions.create(**asked).choices[0].message.content
    assert (
        client.chat.completions.create(**asked, extra_body={"echo": True}).choices[0].message.content == alone
    )


def test_continue_final_message_with_a_new_turn_is_a_400_naming_both(server: Any, model_name: str) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": STARTED}]
    for route, body in (
        ("/v1/chat/completions", {"model": model_name, "max_tokens": 2}),
        ("/tokenize", {}),
    ):
        resp = httpx.post(
            f"{server.url}{route}",
            json={**body, "messages": messages, "continue_final_message": True},
            timeout=60,
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "continue_final_message" and "add_generation_prompt" in error["message"]


def test_a_request_chat_template_needs_the_trust_flag(server: Any, model_name: str) -> None:
    for route, body in (
        ("/v1/chat/completions", {"model": model_name, "max_tokens": 2}),
        ("/tokenize", {}),
    ):
        resp = httpx.post(
            f"{server.url}{route}",
            json={**body, "messages": QUESTION, "chat_template": DOC_TEMPLATE},
            timeout=60,
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


def test_a_trusted_request_template_renders_the_documents(
    trusting_server: Any, client: Any, model_name: str
) -> None:
    documents = [{"title": "moon", "text": "The moon is made of rock."}]
    controls = {"chat_template": DOC_TEMPLATE, "documents": documents}
    prompt = tokenize(trusting_server, messages=QUESTION, **controls)
    rendered = trusting_server.state.tokenizer.decode(prompt)
    assert rendered == "<doc moon>The moon is made of rock.</doc>\nuser: Count to ten.\nassistant:"
    resp = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=1, extra_body=controls
    )
    assert resp.usage.prompt_tokens == len(prompt)


def test_add_special_tokens_true_tokenizes_the_rendered_prompt_with_them(
    server: Any, client: Any, model_name: str
) -> None:
    """As vLLM: the template's text encoded with the tokenizer's own special tokens (BOS and the like)."""
    tokenizer = server.state.tokenizer
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    with_them = tokenize(server, messages=QUESTION, add_special_tokens=True)
    assert with_them == tokenizer.encode(text, add_special_tokens=True)
    resp = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=1, extra_body={"add_special_tokens": True}
    )
    assert resp.usage.prompt_tokens == len(with_them)
