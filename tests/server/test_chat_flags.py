"""`specfleet serve`'s chat flags (vLLM's spelling): parsed into one ChatOptions, and a bad combination or a
missing template file stops the start with a message naming the flag, before the model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from specfleet.engine.server.cli import build_parser, chat_options

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "chatml_tools.jinja"


def test_the_flags_make_the_servers_chat_options() -> None:
    args = build_parser().parse_args(
        [
            "--chat-template",
            str(TEMPLATE),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "qwen3_xml",
            "--reasoning-parser",
            "qwen3",
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
        ]
    )
    options = chat_options(args)
    assert options.chat_template == TEMPLATE.read_text()
    assert options.tool_parser is not None and options.tool_parser.name == "qwen3_xml"
    assert options.reasoning_parser is not None and options.reasoning_parser.name == "qwen3"
    assert options.default_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chat-template", "/nonexistent/t.jinja"], "--chat-template '/nonexistent/t.jinja' is not a file"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tool-call-parser", "hermes"], "--tool-call-parser is used only with --enable-auto-tool-choice"),
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must be a JSON object"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_a_bad_chat_flag_stops_the_start_naming_it(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specfleet.engine.server.cli",
            "--model",
            "bundled://smollm2-135m-instruct",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
