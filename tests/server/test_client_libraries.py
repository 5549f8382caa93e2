"""The client libraries applications are built on, against the real server (the shared one, with the
tool-aware test template and --enable-auto-tool-choice --tool-call-parser hermes): LangChain's ChatOpenAI
(invoke, stream, with_structured_output in the json_schema and function_calling methods, bind_tools),
LiteLLM (completion, streamed) and the OpenAI Agents SDK (an agent with a function tool, run to a final
answer under tool_choice="required"). Greedy and short, so each call takes well under a second of decode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field
from specfleet.engine.server.chat import ChatOptions

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "chatml_tools.jinja"
QUESTION = "What is the weather in Paris?"


class Colour(BaseModel):
    """A colour, by name."""

    name: str = Field(max_length=12)


@pytest.fixture
def tool_server(server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    options = ChatOptions.from_flags(
        chat_template=str(TEMPLATE), enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    monkeypatch.setattr(server.state, "chat", options)
    yield server


@pytest.fixture
def chat_model(tool_server: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=tool_server.state.model_name,
        base_url=f"{tool_server.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=24,
        max_retries=0,
    )


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def test_langchain_invoke_and_stream_say_the_same(chat_model: Any) -> None:
    whole = chat_model.invoke(QUESTION)
    assert isinstance(whole.content, str) and whole.content
    assert "".join(chunk.content for chunk in chat_model.stream(QUESTION)) == whole.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model: Any, method: str) -> None:
    answer = chat_model.with_structured_output(Colour, method=method).invoke("Name a colour.")
    assert isinstance(answer, Colour) and answer.name


def test_langchain_bind_tools(chat_model: Any) -> None:
    bound = chat_model.bind_tools([get_weather], tool_choice="required")
    message = bound.invoke(QUESTION)
    assert [call["name"] for call in message.tool_calls] == ["get_weather"] * len(message.tool_calls)
    assert message.tool_calls and all(
        isinstance(call["args"].get("city"), str) for call in message.tool_calls
    )
    chunks = list(bound.stream(QUESTION))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk  # LangChain's own accumulation of delta.tool_calls
    streamed = [(c["name"], c["args"]) for c in merged.tool_calls]
    assert streamed == [(c["name"], c["args"]) for c in message.tool_calls]


def test_litellm_completion_and_stream(tool_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list at import
    import litellm

    request = {
        "model": f"openai/{tool_server.state.model_name}",
        "api_base": f"{tool_server.url}/v1",
        "api_key": "unused",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 16,
    }
    whole = litellm.completion(**request).choices[0].message.content
    assert whole
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **request)
    )
    assert streamed == whole


def test_agents_sdk_runs_a_function_tool_to_a_final_answer(tool_server: Any) -> None:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    calls: list[str] = []

    @agents.function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIChatCompletionsModel(
        model=tool_server.state.model_name,
        openai_client=AsyncOpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0),
    )
    agent = agents.Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        model=model,
        tools=[weather],
        # required for the first turn; the SDK resets it to auto after a tool call (reset_tool_choice)
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=24),
    )
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=4)
    assert calls, "the tool ran"
    assert isinstance(result.final_output, str) and result.final_output
    tool_outputs = [item for item in result.new_items if isinstance(item, agents.ToolCallOutputItem)]
    assert [json.dumps(item.output) for item in tool_outputs] == [json.dumps(f"sunny in {c}") for c in calls]
