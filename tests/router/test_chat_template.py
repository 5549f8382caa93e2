"""The router renders a chat request as the engine does (router/chat_template.py), token for token.

The oracle is the engine's own path: the model folder's tokenizer as the engine loads it
(engine/checkpoint.py `load_tokenizer`, transformers), the request parsed by the server's protocol and
rendered by engine/server/chat.py `render_with`. The router's side is its template, rendered by its own
jinja2 code, and the tokenizer.json through the `tokenizers` library as `specfleet router --tokenizer`
loads it. Three templates: the bundled SmolLM2's, and two written here in the shape of Llama 3.1's (BOS
variable, tools as JSON in a user turn, `strftime_now`, `raise_exception`, documents, `| trim`) and Qwen's
(ChatML, tools in XML, tool calls and grouped tool results, a namespace, a `{% generation %}` block, an
`enable_thinking` kwarg); and a model with two named templates (default, tool_use)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from specfleet.router.chat_template import RESERVED_KWARGS, ChatTemplate, Unrenderable

LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if documents %}
    {%- for d in documents %}{{- "Document " ~ loop.index ~ " (" ~ d.title ~ "): " ~ d.text ~ "\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {{- "<|start_header_id|>user<|end_header_id|>\\n\\n" }}
    {{- "Answer a function call as JSON {\\"name\\": name, \\"parameters\\": {...}}.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- elif message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}{{- raise_exception("one tool call per turn") }}{%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- "<|start_header_id|>" + message.role + "<|end_header_id|>\\n\\n" + message.content | trim }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{%- endif %}
"""

QWEN_STYLE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nReturn each call as JSON within <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {%- if loop.index0 == ns.last_user and message.name is defined %}{{- ' (' + message.name + ')' }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
        {{- message.content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
                {%- if tool_call.function.arguments is string %}{{- tool_call.function.arguments }}
                {%- else %}{{- tool_call.function.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {%- endgeneration %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"], "default": None}},
            "required": ["city"],
        },
    },
}
# keys out of the declared order, a null description, keys the protocol does not declare
ODD_TOOL = {
    "function": {
        "x-owner": "ops",
        "parameters": {"type": "object"},
        "description": None,
        "name": "page_oncall",
    },
    "x-priority": 2,
    "type": "function",
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant for ACME's support desk.  "},
    {"role": "user", "content": "What do you know about ACME?"},
    {"role": "assistant", "content": "ACME sells anvils."},
    {"role": "user", "content": "And rockets?"},
]
REQUESTS: dict[str, dict[str, Any]] = {
    "turns": {"messages": CONVERSATION},
    "parts_and_developer": {
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Cite."}],
            },
            {"role": "user", "content": [{"type": "text", "text": "héllo – 世界"}], "name": "ana"},
        ]
    },
    "no_generation_prompt": {"messages": CONVERSATION[:3], "add_generation_prompt": False},
    "continue_final": {
        "messages": [*CONVERSATION[:2], {"role": "assistant", "content": "ACME is "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "tools": {
        "messages": [
            {"role": "system", "content": "You check the weather."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "no alerts"},
        ],
        "tools": [WEATHER, ODD_TOOL],
        "tool_choice": "auto",
    },
    # parts OpenAI's message params allow besides text: an assistant's refusal, the Responses API's names
    "refusal_and_responses_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "input_text", "text": "Build me a rocket."}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with rockets."}]},
            {"role": "user", "content": "An anvil, then?"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Anvils are in aisle 3."}]},
            {"role": "user", "content": "Thanks."},
        ]
    },
    # an earlier turn's reasoning sent back (interleaved thinking), under either name
    "reasoning_history": {
        "messages": [
            CONVERSATION[1],
            {
                "role": "assistant",
                "content": "ACME sells anvils.",
                "reasoning_content": "Recall the catalogue.",
            },
            {"role": "user", "content": "And rockets?"},
            {"role": "assistant", "content": "Those too.", "reasoning": "Check the rockets page."},
            {"role": "user", "content": "Thanks."},
        ]
    },
    "kwargs_and_documents": {
        "messages": CONVERSATION[1:2],
        "chat_template_kwargs": {"enable_thinking": False, "date_string": "06 Dec 2026"},
        "documents": [{"title": "Anvils", "text": "Cast iron."}, {"title": "Rockets", "text": "Tested."}],
    },
}


def _model(base: Path, folder: Path, template: str | list[dict[str, str]] | None, **config: Any) -> Path:
    """A model folder: the bundled tokenizer.json, its tokenizer_config.json with `config`'s changes, and
    `template` in chat_template.jinja (a string) or in the config (a list of named templates)."""
    folder.mkdir()
    shutil.copy(base / "tokenizer.json", folder / "tokenizer.json")
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    tokenizer_config.update(config)
    if isinstance(template, list):
        tokenizer_config["chat_template"] = template
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.fixture(scope="module")
def models(bundled_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base, root = Path(bundled_path), tmp_path_factory.mktemp("chat-templates")
    return {
        "smollm2": base,
        # the BOS the template writes is the config's: <|endoftext|>, id 0 in this vocabulary
        "llama3_style": _model(base, root / "llama3", LLAMA3_STYLE, bos_token="<|endoftext|>"),
        "qwen_style": _model(base, root / "qwen", QWEN_STYLE),
        "two_templates": _model(
            base,
            root / "two",
            [{"name": "default", "template": PLAIN}, {"name": "tool_use", "template": QWEN_STYLE}],
        ),
    }


class Engine:
    """The engine's rendering of a chat request (the oracle), and the router's, for one model folder."""

    def __init__(self, folder: Path) -> None:
        from specfleet.engine.checkpoint import load_tokenizer
        from specfleet.router.cli import load_encoder

        self.tokenizer = load_tokenizer(folder)
        template = ChatTemplate.load(folder)
        assert template is not None
        self.template, self.encode = template, load_encoder(str(folder / "tokenizer.json"))

    def engine(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        from specfleet.engine.server.chat import ChatOptions, render_with
        from specfleet.engine.server.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate({"model": "m", **body})
        rendered = render_with(ChatOptions(), self.tokenizer, request, request.tools)
        return rendered.prompt_text, rendered.prompt_ids

    def router(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        text = self.template.render(json.loads(json.dumps({"model": "m", **body})))
        return text, self.encode(text)


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> dict[str, Engine]:
    return {name: Engine(folder) for name, folder in models.items()}


CASES = [
    (model, request)
    for model in ("smollm2", "llama3_style", "qwen_style", "two_templates")
    for request in REQUESTS
    # SmolLM2's template and the plain default render no tools (they ignore them: still compared)
]


@pytest.mark.parametrize(("model", "request_name"), CASES)
def test_the_router_renders_and_tokenizes_a_chat_request_as_the_engine(
    engines: dict[str, Engine], model: str, request_name: str
) -> None:
    engine = engines[model]
    body = REQUESTS[request_name]
    text, ids = engine.engine(body)
    assert engine.router(body) == (text, ids)
    assert len(ids) > 8  # a real prompt, not two empty renderings that agree
    if model == "llama3_style":
        assert ids[0] == 0  # the config's bos_token, written by the template
    if request_name == "refusal_and_responses_parts":
        assert "I cannot help with rockets." in text and "aisle 3" in text and "Build me" in text
    if request_name == "reasoning_history" and model == "qwen_style":  # its template renders it
        assert "<think>\nRecall the catalogue.\n</think>" in text and "Check the rockets page." in text
    if request_name == "tools" and model in ("qwen_style", "two_templates"):
        # the tool_use template, with the tools in the engine's dump order (declared fields first)
        assert '{"type": "function", "function": {"name": "page_oncall", "description"' not in text
        assert '{"type": "function", "function": {"name": "page_oncall", "parameters"' in text
        assert '"x-priority": 2}' in text


def test_each_template_renders_something_of_its_own(engines: dict[str, Engine]) -> None:
    """The cases above are not vacuous: the folders render one request their own ways (Qwen's shape is
    ChatML, as SmolLM2's, until tools come), the model with two templates picks tool_use for a request with
    tools, and the request's own fields change what comes out."""
    texts = {name: e.router(REQUESTS["turns"])[0] for name, e in engines.items()}
    assert texts["smollm2"] == texts["qwen_style"] and len(set(texts.values())) == 3
    assert texts["two_templates"].startswith("system: You are a terse")  # its default template
    tools = {name: e.router(REQUESTS["tools"])[0] for name, e in engines.items()}
    assert tools["two_templates"] == tools["qwen_style"] != tools["smollm2"]
    assert "<tools>" in tools["qwen_style"] and '"name": "get_weather"' in tools["llama3_style"]
    qwen = engines["qwen_style"]
    thinking_off = qwen.router(REQUESTS["kwargs_and_documents"])[0]
    assert thinking_off.endswith("<think>\n\n</think>\n\n")
    assert (
        "Document 2 (Rockets): Tested." in engines["llama3_style"].router(REQUESTS["kwargs_and_documents"])[0]
    )
    assert engines["llama3_style"].router(REQUESTS["continue_final"])[0].endswith("ACME is")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"chat_template": PLAIN}, "request_template"),
        ({"add_special_tokens": True}, "special_tokens"),
        ({"chat_template_kwargs": {"tokenize": True}}, "bad_request"),
        ({"continue_final_message": True}, "bad_request"),  # with add_generation_prompt's default, true
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "bad_request",
        ),
        ({"messages": [{"role": "narrator", "content": "hi"}]}, "bad_request"),
        (  # the kwarg wins over the field, and transformers refuses the pair
            {
                "messages": CONVERSATION[:2],
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template_kwargs": {"add_generation_prompt": True},
            },
            "bad_request",
        ),
    ],
)
def test_what_the_router_cannot_render_it_says_why(
    engines: dict[str, Engine], change: dict, reason: str
) -> None:
    """Each is hashed on the estimate; a request the router calls bad (or a request-level template, on a
    server without --trust-request-chat-template) the engine refuses too: its blocks never reach a cache."""
    body = {**REQUESTS["turns"], **change}
    with pytest.raises(Unrenderable) as caught:
        engines["smollm2"].router(body)
    assert caught.value.reason == reason
    if reason in ("bad_request", "request_template"):
        with pytest.raises(Exception, match="continue_final_message|chat_template|validation error"):
            engines["smollm2"].engine(body)


def test_a_template_that_raises_is_the_engines_400_and_the_routers_template_error(
    engines: dict[str, Engine],
) -> None:
    from specfleet.engine.server.errors import APIError

    two_calls = {
        "messages": [{"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]}]
    }
    with pytest.raises(APIError, match="one tool call per turn"):
        engines["llama3_style"].engine(two_calls)
    with pytest.raises(Unrenderable, match="one tool call per turn") as caught:
        engines["llama3_style"].router(two_calls)
    assert caught.value.reason == "template_error"


def test_the_reserved_kwargs_are_the_engines(engines: dict[str, Engine]) -> None:
    from specfleet.engine.server.chat import reserved_kwargs

    assert reserved_kwargs(type(engines["smollm2"].tokenizer)) == RESERVED_KWARGS


def test_a_model_without_a_template_has_none_and_a_broken_one_names_its_folder(
    bundled_path: str, tmp_path: Path
) -> None:
    assert ChatTemplate.load(_model(Path(bundled_path), tmp_path / "none", None)) is None
    broken = _model(Path(bundled_path), tmp_path / "broken", "{% for m in messages %}")
    with pytest.raises(ValueError, match="broken.*does not compile"):
        ChatTemplate.load(broken)


def test_the_sandbox_holds() -> None:
    """A template is code from the model's folder: transformers' sandbox rules hold here too."""
    escape = ChatTemplate({"default": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(Unrenderable) as caught:
        escape.render({"messages": [{"role": "user", "content": "hi"}]})
    assert caught.value.reason == "template_error"
    underscore = ChatTemplate({"default": "{% set ns = namespace(_x=1) %}{{ ns._x }}"})
    with pytest.raises(Unrenderable, match="SecurityError"):
        underscore.render({"messages": [{"role": "user", "content": "hi"}]})


def test_the_engines_chat_flags_make_the_router_render_as_those_engines(
    models: dict[str, Path], engines: dict[str, Engine], tmp_path: Path
) -> None:
    """A router given the engines' --chat-template, --default-chat-template-kwargs and
    --exclude-tools-when-tool-choice-none (its own flags, or the engine arguments `specfleet up` starts its
    engines with) renders what engines started with them render: the file instead of the model's template,
    the default kwargs under the request's, the tools left out for tool_choice "none"."""
    from specfleet.engine.server import chat
    from specfleet.engine.server.protocol import ChatCompletionRequest
    from specfleet.fleet.supervisor import local_chat_template
    from specfleet.router import cli as router_cli

    (tmp_path / "qwen.jinja").write_text(QWEN_STYLE)
    flags = [
        "--chat-template",
        str(tmp_path / "qwen.jinja"),
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--exclude-tools-when-tool-choice-none",
    ]
    options = chat.ChatOptions.from_flags(
        chat_template=str(tmp_path / "qwen.jinja"),
        default_chat_template_kwargs='{"enable_thinking": false}',
        exclude_tools_when_tool_choice_none=True,
    )
    args = router_cli.build_parser().parse_args(
        ["--endpoint", "http://x:1", "--tokenizer", str(models["smollm2"]), *flags]
    )
    router = router_cli.build_router(args)
    fleet_template = local_chat_template(f"file://{models['smollm2']}", ["--max-model-len=512", *flags])
    assert router.chat_template is not None and fleet_template is not None
    smollm2 = engines["smollm2"]
    for body in (REQUESTS["turns"], {**REQUESTS["tools"], "tool_choice": "none"}):
        request = ChatCompletionRequest.model_validate({"model": "m", **body})
        expected = chat.render(options, smollm2.tokenizer, request, chat.plan(options, request)).prompt_text
        assert "<think>\n\n</think>" in expected and "<tools>" not in expected  # the flags at work
        assert router.chat_template.render(body) == fleet_template.render(body) == expected
    with pytest.raises(ValueError, match="--default-chat-template-kwargs must be a JSON object"):
        router_cli.build_router(
            router_cli.build_parser().parse_args(
                [
                    "--endpoint",
                    "http://x:1",
                    "--tokenizer",
                    str(models["smollm2"]),
                    "--default-chat-template-kwargs",
                    "[1]",
                ]
            )
        )
