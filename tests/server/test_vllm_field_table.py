"""docs/server.md's "Request fields" table names every request field of vLLM's protocol, as generated from
vLLM's source into tests/fixtures/vllm_request_fields.json (tests/fixtures/generate_vllm_fields.py): a
field vLLM adds upstream fails here until the table says what specfleet does with it. The table's verdicts
are checked against the request models, so a row cannot claim what the code does not do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from specfleet.engine.server.lenient import REFUSED_UNLESS_DEFAULT
from specfleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[2]
VLLM = json.loads((ROOT / "tests/fixtures/vllm_request_fields.json").read_text())
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
VERDICTS = ("honoured", "ignored", "refused", "tools")


def table_rows() -> list[tuple[list[str], list[str], str]]:
    """(fields, routes, verdict) per row of the Request fields table."""
    text = (ROOT / "docs/server.md").read_text()
    section = text.split("\n## Request fields\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        fields_cell, routes_cell, what = (c.strip() for c in line.strip("|").split("|", 2))
        routes = list(MODELS) if routes_cell == "both" else [r.strip() for r in routes_cell.split(",")]
        verdict = what.split(maxsplit=1)[0].rstrip(":,;")
        rows.append((re.findall(r"`([^`]+)`", fields_cell), routes, verdict))
    return rows


def test_the_field_list_came_from_vllm_at_a_commit() -> None:
    assert re.fullmatch(r"[0-9a-f]{40}", VLLM["commit"])
    chat = VLLM["routes"]["/v1/chat/completions"]["fields"]
    completions = VLLM["routes"]["/v1/completions"]["fields"]
    assert {"messages", "tools"} <= set(chat) and {"prompt", "suffix"} <= set(completions)


@pytest.mark.parametrize(
    ("route", "key"), [("chat", "/v1/chat/completions"), ("completions", "/v1/completions")]
)
def test_every_vllm_field_is_in_the_table(route: str, key: str) -> None:
    named = {field for fields, routes, _ in table_rows() if route in routes for field in fields}
    missing = [f for f in VLLM["routes"][key]["fields"] if f not in named]
    assert not missing, (
        f"vLLM's {key} has fields docs/server.md's Request fields table does not name: {missing}"
    )


def test_each_verdict_matches_the_code() -> None:
    rows = table_rows()
    assert rows and all(verdict in VERDICTS for _, _, verdict in rows), [
        r for r in rows if r[2] not in VERDICTS
    ]
    for fields, routes, verdict in rows:
        for route in routes:
            declared = MODELS[route].model_fields
            for field in fields:
                if verdict == "honoured":
                    assert field in declared, f"{field} ({route}) is said to be honoured but not read"
                elif verdict == "refused":
                    assert field in declared or field in REFUSED_UNLESS_DEFAULT, f"{field} ({route})"
                elif verdict == "ignored":
                    assert field not in REFUSED_UNLESS_DEFAULT, f"{field} ({route}) is refused, not ignored"


def test_the_generator_reads_fields_as_pydantic_does() -> None:
    """ClassVars and private names are not fields; a base class in the same file is followed, one elsewhere is
    recorded as not followed (vLLM's OpenAIBaseModel declares no request field)."""
    import ast
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", ROOT / "tests/fixtures/generate_vllm_fields.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    source = """
class Shared(OpenAIBaseModel):
    model: str | None = None
    field_names: ClassVar[set[str] | None] = None

class ChatCompletionRequest(Shared):
    messages: list[dict]
    _DEFAULTS: dict = {}
    n: int | None = 1
    model: str | None = None
    def helper(self) -> int:
        local: int = 1
        return local
"""
    fields, outside = gen.class_fields(ast.parse(source), "ChatCompletionRequest")
    assert fields == ["model", "messages", "n"] and outside == ["OpenAIBaseModel"]
