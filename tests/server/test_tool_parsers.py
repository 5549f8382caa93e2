"""The tool-call and reasoning parsers on known text: each format's calls, malformed calls as content, and
the streaming property the server relies on: what a prefix of the output yields is a prefix of what the
whole output yields (content, reasoning and calls only grow)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from specfleet.engine.server.reasoning import get_reasoning_parser
from specfleet.engine.server.tool_parsers import get_tool_parser
from specfleet.engine.server.tools import required_calls

SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
}
CASES = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}</tool_call>',
        "Let me look.\n",
        [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Rome", "days": 1})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}',
        "",
        [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Rome", "days": 1})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
        "Sure. ",
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]get_weather{"city": "Rome", "days": 1}',
        "",
        [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Rome", "days": 1})],
    ),
    (
        "qwen3_xml",
        "On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "On it.\n",
        [("get_weather", {"city": "New York", "days": 3})],
    ),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[c[0] for c in CASES])
def test_each_format_reads_its_calls_and_streams_only_growing_parts(name, text, content, calls) -> None:
    parser = get_tool_parser(name)
    whole = parser.parse(text, True, SCHEMAS)
    assert whole.content == content
    assert [(n, json.loads(a)) for n, a in whole.calls] == calls
    for end in range(len(text) + 1):
        part = parser.parse(text[:end], False, SCHEMAS)
        assert whole.content.startswith(part.content), (end, part.content)
        assert part.calls == whole.calls[: len(part.calls)], end


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": Oslo}}</tool_call>'),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"'),
        ("mistral", "[TOOL_CALLS][{'name': 'x'}]"),
        ("qwen3_xml", "<tool_call><function=get_weather><parameter=city>Oslo</tool_call>"),
    ],
)
def test_a_malformed_call_is_content(name, text) -> None:
    parsed = get_tool_parser(name).parse(text, True, SCHEMAS)
    assert parsed.calls == [] and parsed.content == text


def test_an_unknown_parser_names_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--tool-call-parser 'nope'.*hermes"):
        get_tool_parser("nope")


def test_required_output_is_read_call_by_call_as_it_is_written() -> None:
    text = '[{"name": "a", "parameters": {"x": "}]"}}, {"name": "b", "parameters": {}}]'
    whole = required_calls(text)
    assert whole is not None
    assert [(c.name, json.loads(c.arguments), c.done) for c in whole] == [
        ("a", {"x": "}]"}, True),
        ("b", {}, True),
    ]
    for end in range(len(text) + 1):
        part = required_calls(text[:end])
        assert part is not None, end
        for got, final in zip(part, whole):
            assert got.name == final.name and final.arguments.startswith(got.arguments), (end, got)
    assert required_calls("Hello") is None


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "I should add.</think>\n\nIt is 4.", "I should add.", "It is 4."),
        ("deepseek_r1", "<think>Hmm</think>Yes", "Hmm", "Yes"),
        ("deepseek_r1", "Still thinking", "Still thinking", ""),
        ("qwen3", "<think>\nWhy</think>Because", "\nWhy", "Because"),
        ("qwen3", "No thoughts here", None, "No thoughts here"),
    ],
)
def test_reasoning_splits_and_streams_only_growing_parts(name, text, reasoning, content) -> None:
    parser = get_reasoning_parser(name)
    whole = parser.split(text, True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for end in range(len(text) + 1):
        part = parser.split(text[:end], False)
        assert (whole.reasoning or "").startswith(part.reasoning or ""), (end, part)
        assert whole.content.startswith(part.content), (end, part)


def test_call_ids_are_vllms_and_mistrals_are_nine_letters_or_digits() -> None:
    """Mistral's chat templates refuse any other tool_call_id when the call comes back in the next turn."""
    ids = {get_tool_parser("mistral").call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert get_tool_parser("hermes").call_id().startswith("chatcmpl-tool-")


def test_qwen3_xml_takes_a_schema_without_properties_as_untyped() -> None:
    text = "<tool_call><function=f><parameter=n>\n7\n</parameter></function></tool_call>"
    parsed = get_tool_parser("qwen3_xml").parse(text, True, {"f": {"type": "object", "properties": ["n"]}})
    assert parsed.calls == [("f", '{"n": 7}')]
