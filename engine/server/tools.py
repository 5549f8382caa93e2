"""Tool calling as vLLM's OpenAI server does it: the request's tools and tool_choice, the grammar that makes
`required` and a named function work for any model, and the tool calls read back from the output.

`tool_choice`:
- `none`: free text; the tools still reach the chat template.
- a named function `{"type": "function", "function": {"name": X}}`: the output is constrained to X's
  `parameters` schema; the whole output is that call's arguments.
- `required`: the output is constrained to a JSON array of `{"name": ..., "parameters": ...}` objects, one
  `anyOf` branch per tool (vLLM's `get_json_schema_from_tools`); `parallel_tool_calls: false` caps it at one.
- `auto`: free text, read by the tool-call parser named at start (tool_parsers.py); with
  `parallel_tool_calls: false` only the first call read is answered, as vLLM does.

The output of a constrained choice is read with `required_calls`, which also reads a prefix of it, so that a
stream sends each call's id and name as soon as they are known and then its arguments as they are written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specfleet.engine.structured_output.spec import StructuredOutputSpec

from .errors import APIError

if TYPE_CHECKING:  # the request models (pydantic, tool_models.py); this module reads their attributes only
    from .tool_models import AssistantToolCall, ChatTool, ToolChoice

# A function's parameters when the tool gives none (vLLM does the same): an object with no properties.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_FLAGS_MESSAGE = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
    "(specfleet serve ... --enable-auto-tool-choice --tool-call-parser hermes|llama3_json|mistral|qwen3_xml)"
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the choice in force and, for a constrained one, its grammar."""

    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function's name
    spec: StructuredOutputSpec | None = None
    # parallel_tool_calls: false under auto: only the first call the parser reads is answered (vLLM #26233;
    # the text is generated as the model writes it, the calls after the first are dropped)
    one_call: bool = False

    @property
    def constrained(self) -> bool:
        return self.spec is not None


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    auto_parser: str | None,
) -> ToolPlan:
    """The tool choice in force (OpenAI's default: auto with tools, none without), checked: a 400 names the
    field and what to change."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not isinstance(tool_choice, str):  # a NamedToolChoice
        name = tool_choice.function.name
        tool = next((t for t in tools or [] if t.function.name == name), None)
        if tool is None:
            known = ", ".join(t.function.name for t in tools or []) or "none"
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not in tools (tools: {known})",
                "tool_choice",
                "invalid_value",
            )
        return ToolPlan("named", name, StructuredOutputSpec.json_schema(_parameters(tool), "tool_choice"))
    if tool_choice != "none" and not tools:
        raise APIError(
            400,
            f'tool_choice="{tool_choice}" needs tools: the request has none',
            "tool_choice",
            "invalid_value",
        )
    if tool_choice == "required":
        assert tools is not None, "checked above: required needs tools"
        schema = required_schema(tools, one_call=parallel_tool_calls is False)
        return ToolPlan("required", None, StructuredOutputSpec.json_schema(schema, "tool_choice"))
    if tool_choice == "auto" and auto_parser is None:
        raise APIError(400, AUTO_FLAGS_MESSAGE, "tool_choice", "invalid_value")
    return ToolPlan(tool_choice, one_call=tool_choice == "auto" and parallel_tool_calls is False)


def required_schema(tools: list[ChatTool], one_call: bool = False) -> dict[str, Any]:
    """A JSON array of one or more calls `{"name": N, "parameters": P}`, each a branch per tool; `$defs`
    of the tools' schemas hoisted to the top (a name defined twice differently is a 400)."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        params = dict(_parameters(tool))
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise APIError(
                400,
                f"tools: {tool.function.name}'s parameters.$defs must be an object of schemas",
                "tools",
                "invalid_value",
            )
        for key, value in tool_defs.items():
            if key in defs and defs[key] != value:
                raise APIError(
                    400,
                    f"tools define $defs/{key} twice with different schemas; rename one of them",
                    "tools",
                    "invalid_value",
                )
            defs[key] = value
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if one_call:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters else EMPTY_PARAMETERS


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (HF `apply_chat_template(tools=...)`): whole
    `{"type": "function", "function": {...}}` dicts."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_tool_calls(calls: list[AssistantToolCall]) -> list[dict[str, Any]]:
    """An assistant message's tool calls for the template. Templates read `arguments` as a mapping (they
    `tojson` it), so JSON-object arguments are parsed, as vLLM does; other text stays as it came."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        out.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return out


def new_call_id() -> str:
    """vLLM's tool-call id (`chatcmpl-tool-<hex>`), when no parser is configured."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class PartialCall:
    """A tool call as far as the output has written it: `arguments` is JSON text, complete when `done`."""

    name: str
    arguments: str
    done: bool = False


_WS = " \t\r\n"
_NAME_KEY = re.compile(r'\{\s*"name"\s*:\s*')
_PARAMS_KEY = re.compile(r'\s*,\s*"parameters"\s*:\s*')


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at `text[start]` (an object, array or string), or
    None if the text ends before it does."""
    opener = text[start]
    if opener == '"':
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def required_calls(text: str) -> list[PartialCall] | None:
    """The calls of a `required` output, `[{"name": N, "parameters": {...}}, ...]`, read as far as written:
    a call appears once its name is complete, its arguments grow as the output does (the grammar writes
    `name` first: the schema's property order). None when the text is not such an array."""
    i = _skip_ws(text, 0)
    if i == len(text):
        return []
    if text[i] != "[":
        return None
    calls: list[PartialCall] = []
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            return calls
        if text[i] == ",":
            i += 1
            continue
        match = _NAME_KEY.match(text, i)
        if match is None:
            return calls if _could_start(text[i:], '{"name":') else None
        name_start = match.end()
        if name_start >= len(text):
            return calls
        name_end = json_value_end(text, name_start) if text[name_start] == '"' else -1
        if name_end is None:
            return calls
        if name_end < 0:
            return None
        name = json.loads(text[name_start:name_end])
        params = _PARAMS_KEY.match(text, name_end)
        if params is None or params.end() >= len(text):
            if (
                params is None
                and text[name_end:].strip(_WS)
                and not _could_start(text[name_end:].lstrip(_WS), ',"parameters":')
            ):
                return None
            calls.append(PartialCall(name, ""))
            return calls
        value_start = params.end()
        value_end = json_value_end(text, value_start)
        if value_end is None:
            calls.append(PartialCall(name, text[value_start:]))
            return calls
        calls.append(PartialCall(name, text[value_start:value_end], done=True))
        close = _skip_ws(text, value_end)
        if close < len(text) and text[close] != "}":
            return None
        i = close + 1


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _could_start(text: str, prefix: str) -> bool:
    """Whether `text`, whitespace aside, is a beginning of `prefix`: a call still being written."""
    squeezed = "".join(ch for ch in text if ch not in _WS)
    return prefix.startswith(squeezed)
