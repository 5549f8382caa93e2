"""`specfleet serve`'s chat flags (vLLM's spelling): parsed into one ChatOptions, and a bad combination or a
missing template file stops the start with a message naming the flag, before the model loads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from specfleet.engine.python_child import python_command
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
            "--trust-request-chat-template",
        ]
    )
    options = chat_options(args)
    assert options.chat_template == TEMPLATE.read_text()
    assert options.tool_parser is not None and options.tool_parser.name == "qwen3_xml"
    assert options.reasoning_parser is not None and options.reasoning_parser.name == "qwen3"
    assert options.default_template_kwargs == {"enable_thinking": False}
    assert options.trust_request_chat_template
    assert not chat_options(build_parser().parse_args([])).trust_request_chat_template  # vLLM's default


@pytest.mark.slow  # a `specfleet serve` process per case (it exits before the model loads)
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
        python_command(
            "-m",
            "specfleet.engine.server.cli",
            "--model",
            "bundled://smollm2-135m-instruct",
            *flags,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


@pytest.mark.slow  # starts `specfleet serve` with the bundled model
def test_specfleet_serve_answers_tools_under_its_chat_flags(tmp_path: Path) -> None:
    """The README's command with the chat flags: the template file and the parser reach the routes."""
    import openai
    from helpers import start_server, stop_process

    proc, url = start_server(
        tmp_path / "serve.log",
        "--chat-template",
        str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        tool = {
            "type": "function",
            "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
        }
        ask = [{"role": "user", "content": "Ping."}]
        model = client.models.list().data[0].id
        # auto is the default with tools: answered (no 400 naming the flags), by the hermes parser
        assert client.chat.completions.create(model=model, messages=ask, tools=[tool], max_tokens=4).choices
        named = client.chat.completions.create(
            model=model,
            messages=ask,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "ping"}},
            max_tokens=8,
            temperature=0,
        )
        assert [(c.function.name, c.function.arguments) for c in named.choices[0].message.tool_calls] == [
            ("ping", "{}")
        ]
    finally:
        stop_process(proc)
