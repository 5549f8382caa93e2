"""Tool calling against the real server with the official openai client: named and required choices under
their grammar, streamed calls reassembled by the client, assistant tool calls and tool results through the
chat template, auto with a parser (and malformed call text back as content), the refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from specfleet.engine.server.chat import ChatOptions

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "chatml_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
# Greedy and short: the arguments of these schemas fit well within it.
FAST: dict[str, Any] = {"temperature": 0, "max_tokens": 60}


@pytest.fixture
def tool_server(server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The shared server with --chat-template (a tool-aware ChatML) and --enable-auto-tool-choice
    --tool-call-parser hermes, as `specfleet serve` builds them from its flags."""
    options = ChatOptions.from_flags(
        chat_template=str(TEMPLATE), enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    monkeypatch.setattr(server.state, "chat", options)
    yield server


def _check_call(call: Any) -> dict[str, Any]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    assert call.id and call.type == "function"
    return arguments


def test_a_named_function_answers_with_arguments_that_follow_its_schema(client, tool_server) -> None:
    response = client.chat.completions.create(
        model=tool_server.state.model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **FAST,
    )
    choice = response.choices[0]
    assert choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check_call(choice.message.tool_calls[0])
    assert choice.finish_reason == "stop"  # OpenAI's for a named function


def test_required_without_parallel_calls_answers_one_call_of_a_given_tool(client, tool_server) -> None:
    response = client.chat.completions.create(
        model=tool_server.state.model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        **FAST,
    )
    choice = response.choices[0]
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    assert choice.message.content is None
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_streamed_tool_calls_reassemble_in_the_official_client(client, tool_server, tool_choice) -> None:
    request = {
        "model": tool_server.state.model_name,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        **FAST,
    }
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **request))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) > 1, "the arguments arrive in fragments as they are written"
    first = deltas[0].tool_calls[0]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name
    later = [d.tool_calls[0] for d in deltas[1:]]
    assert all(t.id is None and t.function.name is None for t in later if t.index == 0), later
    with client.chat.completions.stream(**request) as stream:  # the client's own accumulation
        final = stream.get_final_completion().choices[0]
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert final.finish_reason == whole.finish_reason == chunks[-1].choices[0].finish_reason
    for call in final.message.tool_calls:
        _check_call(call)


def test_tool_calls_and_tool_results_render_through_the_template(tool_server) -> None:
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_w1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_w1", "content": "sunny, 24 C"},
    ]
    body = {"messages": conversation, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 1}
    response = httpx.post(
        f"{tool_server.url}/v1/chat/completions", json={**body, "prompt_logprobs": 0}, timeout=60
    )
    assert response.status_code == 200, response.text
    prompt = "".join(
        next(iter(entry.values()))["decoded_token"] for entry in response.json()["prompt_logprobs"][1:]
    )
    assert json.dumps(WEATHER) in prompt  # the tool, as the template's `tools`
    assert (
        '<tool_call>{"id": "call_w1", "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
        in prompt
    )
    assert '<tool_response id="call_w1">\nsunny, 24 C\n</tool_response>' in prompt


def test_tool_choice_none_keeps_the_tools_in_the_prompt_unless_the_server_excludes_them(
    tool_server, monkeypatch
) -> None:
    def prompt() -> str:
        body = {
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "none",
            "max_tokens": 1,
            "prompt_logprobs": 0,
        }
        response = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return "".join(
            next(iter(e.values()))["decoded_token"] for e in response.json()["prompt_logprobs"][1:]
        )

    assert json.dumps(WEATHER) in prompt()
    options = ChatOptions.from_flags(chat_template=str(TEMPLATE), exclude_tools_when_tool_choice_none=True)
    monkeypatch.setattr(tool_server.state, "chat", options)
    assert "<tools>" not in prompt() and "What is the weather in Paris" in prompt()


def test_auto_reads_the_models_calls_and_gives_malformed_ones_back_as_content(client, tool_server) -> None:
    """The output is forced with a regex, so the parser's input is known: a well-formed hermes call, then
    the same with broken arguments."""
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": Oslo}}</tool_call>'
    request = {"model": tool_server.state.model_name, "messages": ASK, "tools": [WEATHER], **FAST}

    def forced(text: str) -> dict[str, Any]:
        return {"structured_outputs": {"regex": "".join("\\" + ch if ch in "{}[]()" else ch for ch in text)}}

    called = client.chat.completions.create(tool_choice="auto", extra_body=forced(good), **request).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in called.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})
    ]
    with client.chat.completions.stream(extra_body=forced(good), **request) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert [c.function.arguments for c in streamed.message.tool_calls] == [
        c.function.arguments for c in called.message.tool_calls
    ]
    malformed = client.chat.completions.create(extra_body=forced(bad), **request).choices[0]
    assert malformed.message.content == bad and not malformed.message.tool_calls
    assert malformed.finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, extra_body=forced(bad), **request))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == bad


def test_auto_with_parallel_tool_calls_false_answers_the_first_call_only(client, tool_server) -> None:
    """vLLM's reading of `parallel_tool_calls: false` under auto (the model is free to write two calls; the
    answer has the first): LangGraph and the Agents SDK send it to run one tool per turn. The two calls are
    forced with a regex, so the parser's input is known."""
    two = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    regex = "".join("\\" + ch if ch in "{}[]()" else ch for ch in two)
    request = {
        "model": tool_server.state.model_name,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "auto",
        "extra_body": {"structured_outputs": {"regex": regex}},
        **FAST,
        "max_tokens": 120,  # both calls whole (about 60 tokens), so the first cannot be all there is
    }

    def names(message: Any) -> list[str]:
        return [c.function.name for c in message.tool_calls or []]

    both = client.chat.completions.create(**request).choices[0]
    assert names(both.message) == ["get_weather", "get_time"]
    one = client.chat.completions.create(parallel_tool_calls=False, **request).choices[0]
    assert names(one.message) == ["get_weather"] and one.finish_reason == "tool_calls"
    assert one.message.tool_calls[0].function.arguments == both.message.tool_calls[0].function.arguments
    with client.chat.completions.stream(parallel_tool_calls=False, **request) as stream:
        streamed = stream.get_final_completion().choices[0]  # the client's own accumulation of the deltas
    assert names(streamed.message) == ["get_weather"] and streamed.finish_reason == "tool_calls"
    assert (streamed.message.content or None) == one.message.content  # the text between the calls, if any


def test_auto_without_a_parser_is_a_400_naming_the_flags(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.state.model_name, messages=ASK, tools=[WEATHER], **FAST)
    assert "--enable-auto-tool-choice" in str(err.value) and "--tool-call-parser" in str(err.value)
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "keep one"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "may not set"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": 5}}}],
                "tool_choice": "required",
            },
            "tools",
            "$defs must be an object",
        ),
        (
            {"chat_template_kwargs": {"return_tensors": "pt"}},
            "chat_template_kwargs.return_tensors",
            "may not set",
        ),
    ],
)
def test_tool_requests_that_cannot_be_answered_are_400s_naming_the_field(
    tool_server, fields: dict[str, Any], param: str, words: str
) -> None:
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 4, **fields}
    response = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
