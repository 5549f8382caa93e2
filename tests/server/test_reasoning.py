"""Reasoning against the real server: `--reasoning-parser deepseek_r1` splits the output into
`reasoning_content` and `content`, streamed as `delta.reasoning_content`; `chat_template_kwargs` reach the
template; a structured output constrains only what follows the reasoning; `include_reasoning: false` drops it.

The bundled model does not think, so the test template (enable_thinking) decides where its output starts:
`true` opens `<think>` in the prompt (the output is reasoning until `</think>`, which this model does not write
in a few tokens), `false` closes an empty think block there (the output is the answer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from specfleet.engine.server.chat import ChatOptions

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "chatml_tools.jinja"
ASK = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 10}},
    "required": ["colour"],
    "additionalProperties": False,
}
FAST: dict[str, Any] = {"temperature": 0, "max_tokens": 12}
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _options(reasoning_parser: str | None) -> ChatOptions:
    return ChatOptions.from_flags(chat_template=str(TEMPLATE), reasoning_parser=reasoning_parser)


@pytest.fixture
def served(server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The shared server under --chat-template and --reasoning-parser deepseek_r1; `served.plain()` turns the
    parser off (the same output, unsplit)."""
    monkeypatch.setattr(server.state, "chat", _options("deepseek_r1"))
    server.plain = lambda: monkeypatch.setattr(server.state, "chat", _options(None))
    yield server


def _ask(client: Any, served: Any, extra: dict[str, Any], **fields: Any) -> Any:
    return client.chat.completions.create(
        model=served.state.model_name, messages=ASK, extra_body=extra, **FAST, **fields
    ).choices[0]


def test_the_output_after_think_is_reasoning_and_streams_as_reasoning_deltas(client, served) -> None:
    split = _ask(client, served, THINK)
    assert split.message.content is None
    reasoning = split.message.model_extra["reasoning_content"]
    assert reasoning and split.message.model_extra["reasoning"] == reasoning
    chunks = client.chat.completions.create(
        model=served.state.model_name, messages=ASK, stream=True, extra_body=THINK, **FAST
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    deltas = [c.delta for c in choices]
    assert choices[-1].finish_reason == "length" and choices[-1].model_extra["stop_reason"] is None
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert not "".join(d.content or "" for d in deltas)
    served.plain()
    assert _ask(client, served, THINK).message.content == reasoning  # the same output, unsplit


def test_template_kwargs_reach_the_template_and_structured_output_follows_the_reasoning(
    client, served
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA}}
    free = _ask(client, served, THINK).message.model_extra["reasoning_content"]
    thinking = _ask(client, served, THINK, response_format=fmt)
    # still reasoning when max_tokens ends it: nothing was constrained, the reasoning is the free output
    assert thinking.message.model_extra["reasoning_content"] == free
    answered = _ask(client, served, NO_THINK, response_format=fmt)
    # the template closed the reasoning in the prompt: the grammar holds from the first token
    assert answered.message.model_extra["reasoning_content"] is None
    jsonschema.validate(json.loads(answered.message.content), SCHEMA)


def test_include_reasoning_false_drops_it(client, served) -> None:
    message = _ask(client, served, {**THINK, "include_reasoning": False}).message
    assert "reasoning_content" not in (message.model_extra or {}) and "reasoning" not in (
        message.model_extra or {}
    )
    assert message.content is None
