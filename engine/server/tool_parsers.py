"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`, vLLM's names): the model writes its
calls in its own format and a parser reads them out of the text.

A parser reads the whole output so far and returns what it can already tell apart: content (text meant for
the user) and complete calls, both only ever growing as the output grows, so a stream sends the difference
each time. Text that might still become a call (a marker begun, a call not yet closed) is held back until it
is resolved. A block that does not parse as a call is content, never an error: a model that writes a
malformed call gets its text back.

Formats:
- hermes (Hermes, Qwen2.5, QwQ): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  text around them.
- llama3_json (Llama 3.1-3.3): the whole output is `{"name": ..., "parameters": {...}}` (or `arguments`),
  optionally after `<|python_tag|>`, several separated by `;`.
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`, or (tokenizer v11+)
  `name{...}` / `name[ARGS]{...}` per call.
- qwen3_xml (Qwen3-Coder): `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`,
  values typed by the tool's JSON schema.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .tools import new_call_id

Call = tuple[str, str]  # (function name, arguments as JSON text)


@dataclass
class AutoParse:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


class ToolParser:
    """Base: `parse(text, final, schemas)`; `schemas` maps a tool's name to its parameters' JSON schema."""

    name = ""
    # vLLM's adjust_request: the markers of some formats are special tokens, which must stay in the text
    keep_special_tokens = True

    def parse(self, text: str, final: bool, schemas: dict[str, Any]) -> AutoParse:
        raise NotImplementedError

    @staticmethod
    def call_id() -> str:
        """A new tool call's id."""
        return new_call_id()


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text: an object as written, or JSON text of an object; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _json_call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    value: Any = next((obj[k] for k in keys if k in obj), {})
    arguments = _arguments(value)
    return None if arguments is None else (obj["name"], arguments)


def _tagged(text: str, start: str, end: str, final: bool, read: Callable[[str], Call | None]) -> AutoParse:
    """Calls between `start` and `end` markers, text around them as content."""
    out, i = AutoParse(), 0
    while True:
        at = text.find(start, i)
        if at < 0:
            tail = text[i:]
            out.content += tail if final else tail[: len(tail) - held_back(tail, start)]
            return out
        out.content += text[i:at]
        body_start = at + len(start)
        close = text.find(end, body_start)
        if close < 0:
            if final:  # a model that stops without the closing marker: its call still counts if it parses
                call = read(text[body_start:])
                if call is None:
                    out.content += text[at:]
                else:
                    out.calls.append(call)
            return out
        call = read(text[body_start:close])
        if call is None:
            out.content += text[at : close + len(end)]
        else:
            out.calls.append(call)
        i = close + len(end)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool, schemas: dict[str, Any]) -> AutoParse:
        return _tagged(text, "<tool_call>", "</tool_call>", final, lambda body: _json_call(_loads(body)))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool, schemas: dict[str, Any]) -> AutoParse:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :].lstrip()
        elif not (body.startswith("{") or (not final and self.tag.startswith(body))):
            return AutoParse(content=text)  # plain text: streamed as it comes
        if not final:
            return AutoParse()  # a call (or text that looks like one) is read whole at the end
        calls = self._calls(body)
        return AutoParse(calls=calls) if calls else AutoParse(content=text)

    @staticmethod
    def _calls(body: str) -> list[Call]:
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return []
            call = _json_call(obj, ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
            i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
        return calls


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    @staticmethod
    def call_id() -> str:
        """Mistral's chat templates refuse a tool_call_id that is not 9 letters or digits (as vLLM's
        mistral parser makes them), and the ids come back in the next turn's messages."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    _named = re.compile(r"\s*([A-Za-z0-9_.:-]+)\s*(?:\[ARGS\])?\s*")

    def parse(self, text: str, final: bool, schemas: dict[str, Any]) -> AutoParse:
        at = text.find(self.marker)
        if at < 0:
            return AutoParse(content=text if final else text[: len(text) - held_back(text, self.marker)])
        if not final:
            return AutoParse(content=text[:at])
        calls = self._calls(text[at + len(self.marker) :])
        return AutoParse(text[:at], calls) if calls else AutoParse(content=text)

    def _calls(self, body: str) -> list[Call]:
        parsed = _loads(body.strip())
        if isinstance(parsed, list):
            read = [_json_call(obj) for obj in parsed]
            return [c for c in read if c is not None] if read and None not in read else []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while body[i:].strip():  # tokenizer v11+: name{...} per call, each after its own [TOOL_CALLS]
            match = self._named.match(body, i)
            if match is None:
                return []
            try:
                obj, i = decoder.raw_decode(body, match.end())
            except json.JSONDecodeError:
                return []
            arguments = _arguments(obj)
            if arguments is None:
                return []
            calls.append((match.group(1), arguments))
            rest = body[i:].lstrip()
            if rest.startswith(self.marker):
                i = len(body) - len(rest) + len(self.marker)
        return calls


class Qwen3XmlParser(ToolParser):
    name = "qwen3_xml"
    _function = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.S)
    _parameter = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)

    def parse(self, text: str, final: bool, schemas: dict[str, Any]) -> AutoParse:
        return _tagged(text, "<tool_call>", "</tool_call>", final, lambda body: self._call(body, schemas))

    def _call(self, body: str, schemas: dict[str, Any]) -> Call | None:
        match = self._function.match(body)
        if match is None:
            return None
        name = match.group(1)
        properties = (schemas.get(name) or {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments = {
            key: _typed(_strip_newline(raw), properties.get(key))
            for key, raw in self._parameter.findall(match.group(2))
        }
        return name, json.dumps(arguments, ensure_ascii=False)


def _strip_newline(value: str) -> str:
    """The format writes each value on lines of its own: one newline each side is layout, not value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(raw: str, schema: Any) -> Any:
    """A qwen3_xml value as its schema's type says (text when the schema says string or cannot be met)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return raw
    stripped = raw.strip()
    if stripped.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(stripped)
        if kind == "number":
            number = float(stripped)
            return int(number) if number.is_integer() and "." not in stripped else number
        if kind == "boolean":
            return {"true": True, "false": False}[stripped.lower()]
    except (ValueError, KeyError):
        return raw
    value = _loads(stripped)
    return raw if value is None else value


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), Qwen3XmlParser())
}


def get_tool_parser(name: str) -> ToolParser:
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {', '.join(TOOL_PARSERS)}")
    return parser
