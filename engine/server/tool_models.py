"""The tool-calling request models (OpenAI's shapes): the tools a chat request offers, its `tool_choice`,
and the tool calls of earlier assistant turns. Unknown fields inside them are accepted and reported as
everywhere else in a request (lenient.py); tools.py holds what is done with them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .lenient import LenientModel


class FunctionDefinition(LenientModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(LenientModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(LenientModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as OpenAI sends them")


class AssistantToolCall(LenientModel):
    """A tool call in an assistant message of the conversation (what an earlier response returned)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
