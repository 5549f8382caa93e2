"""A chat request's prompt as the engine renders it: the model's own chat template, rendered with jinja2's
sandbox the way transformers' `apply_chat_template` renders it, over the messages, tools and template
kwargs as the engine's server passes them (engine/server/chat.py `render_with`, protocol.py
`ChatMessage.as_template_dict`, tools.py `template_tools`). The router then tokenizes the text with the
model's tokenizer and no added special tokens, as the engine does for a chat request, so a chat request's
blocks are the blocks the engine prefills and the engines' KV events name (router/kv_index.py).

The router imports neither transformers nor the engine (pyproject.toml's import contracts): this module
re-states what they do, and tests/router/test_chat_template.py holds it to both, token for token, over the
bundled model's template and templates shaped like Llama 3's and Qwen's (tools included).

What the router cannot reproduce it does not guess: a request-level `chat_template` (the engine's to
accept or refuse), `add_special_tokens: true`, a request the engine refuses, a template that fails. Each
raises `Unrenderable` with a reason (the router's metric label), and the router matches that request on its
estimate, as it matches every chat request without a template.

jinja2 is imported when a template is loaded: only a router with the model's tokenizer renders, and that
install (the `engine` extra, where `tokenizers` is) declares it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

# The reasons a chat request is hashed on the estimate instead (the metric's `outcome` label, besides
# "rendered"): no template, a request-level template, add_special_tokens, a request the engine refuses with
# a 400 (its blocks never reach the cache), the template raised.
REASONS = ("no_template", "request_template", "special_tokens", "bad_request", "template_error")

# The names chat_template_kwargs may not set, as the engine refuses them (engine/server/chat.py
# `reserved_kwargs`: transformers' `apply_chat_template` parameters except add_generation_prompt, read from
# its signature there; tests/router/test_chat_template.py checks this copy against the engine's).
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# The tokenizer's named special tokens, which every template sees as variables (transformers'
# SPECIAL_TOKENS_ATTRIBUTES; a config's dict of `extra_special_tokens` adds named ones).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})  # protocol.ChatMessage's
# What transformers appends to the final message for continue_final_message, to find where it ends
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class Unrenderable(Exception):
    """The router cannot render this request as the engine would; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TemplateUnusable(ValueError):
    """The model's template does not compile: the engines' chat endpoint answers 400 with it too."""


@dataclass(frozen=True)
class ChatTemplate:
    """The model's chat template(s), compiled, and the special tokens its templates see.

    `templates` maps a name to a template's text; one template is "default", and a model with several
    uses "tool_use" for a request with tools where it has one (transformers' `get_chat_template`)."""

    templates: Mapping[str, str]
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    # The engine server's --default-chat-template-kwargs and --exclude-tools-when-tool-choice-none
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_tools_when_none: bool = False

    def __post_init__(self) -> None:
        env = _environment()
        object.__setattr__(self, "_compiled", {n: env.from_string(t) for n, t in self.templates.items()})

    @classmethod
    def load(
        cls, model_dir: str | Path, engine_flags: argparse.Namespace | None = None
    ) -> ChatTemplate | None:
        """The template of a model folder as transformers loads it: chat_template.jinja (and
        additional_chat_templates/*.jinja) before tokenizer_config.json's `chat_template`; None if the
        model has none. `engine_flags` are the engines' chat flags (`add_engine_chat_flags`): their
        --chat-template's file replaces the model's, as in the engine. ValueError for a template jinja cannot
        compile (TemplateUnusable, naming the folder), and for a bad flag, naming it."""
        folder = Path(model_dir)
        config = _read_json(folder / "tokenizer_config.json")
        flags = engine_flags if engine_flags is not None else argparse.Namespace()
        default_kwargs = _default_kwargs(getattr(flags, "default_chat_template_kwargs", None))
        exclude_tools_when_none = bool(getattr(flags, "exclude_tools_when_tool_choice_none", False))
        templates: dict[str, str] = {}
        override = getattr(flags, "chat_template", None)
        if override is not None:
            if not Path(override).is_file():
                raise ValueError(f"--chat-template {override!r} is not a file (a Jinja chat template)")
            templates["default"] = Path(override).read_text(encoding="utf-8")
        elif (folder / "chat_template.jinja").is_file():
            templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        extra = folder / "additional_chat_templates"
        if extra.is_dir() and override is None:
            for path in sorted(extra.glob("*.jinja")):
                templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
        if not templates and override is None:
            entry = config.get("chat_template")
            if isinstance(entry, str):
                templates["default"] = entry
            elif isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
                templates = {t["name"]: t["template"] for t in entry if isinstance(t, dict)}
        if not templates:
            return None
        try:
            return cls(templates, special_tokens(folder, config), default_kwargs, exclude_tools_when_none)
        except Exception as exc:  # jinja2's TemplateSyntaxError, or anything else the parser raises
            raise TemplateUnusable(f"the chat template in {folder} does not compile: {exc}") from exc

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text the engine's chat endpoint renders for this request body (already parsed JSON)."""
        if body.get("chat_template") is not None:
            raise Unrenderable("request_template", "the request brings its own chat_template")
        if body.get("add_special_tokens"):
            raise Unrenderable(
                "special_tokens", "add_special_tokens=true adds the tokenizer's BOS and the like"
            )
        messages = template_messages(body.get("messages"))
        tools = template_tools(body.get("tools"))
        if self.exclude_tools_when_none and body.get("tool_choice") == "none":
            tools = None
        documents = body.get("documents")
        if documents is not None and not (
            isinstance(documents, list)
            and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)
        ):
            raise Unrenderable("bad_request", "documents must be a list of objects of strings")
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if continue_final and add_generation_prompt:
            raise Unrenderable("bad_request", "continue_final_message with add_generation_prompt")
        request_kwargs = body.get("chat_template_kwargs")
        if request_kwargs is not None and not isinstance(request_kwargs, dict):
            raise Unrenderable("bad_request", "chat_template_kwargs must be an object")
        kwargs = {**self.default_kwargs, **(request_kwargs or {})}
        reserved = sorted(RESERVED_KWARGS & set(kwargs))
        if reserved:
            raise Unrenderable("bad_request", f"chat_template_kwargs may not set {reserved[0]}")
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        if continue_final and add_generation_prompt:  # set by a kwarg: transformers refuses it then
            raise Unrenderable("bad_request", "continue_final_message with add_generation_prompt")
        name = self._pick(tools)
        if continue_final:
            messages = _tag_final_message(messages, self.templates[name])
        try:
            text = self._compiled[name].render(  # type: ignore[attr-defined]
                {**self.special_tokens, **kwargs},
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # raise_exception(), a template bug, a sandbox refusal: the engine's 400
            raise Unrenderable("template_error", f"{type(exc).__name__}: {exc}") from exc
        return _cut_at_tag(text, messages[-1]["content"]) if continue_final else text

    def _pick(self, tools: list[dict[str, Any]] | None) -> str:
        if len(self.templates) == 1 and "default" in self.templates:
            return "default"
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise Unrenderable("no_template", f"the model has templates {sorted(self.templates)} and no default")


def add_engine_chat_flags(p: argparse.ArgumentParser) -> None:
    """The engine server's flags that change what its chat template renders (engine/server/cli.py
    `add_chat_args`: the same names and meanings); a router given the engines' values renders as they do."""
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="the engines' --chat-template: a Jinja chat template file rendered instead of the model's",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="the engines' --default-chat-template-kwargs: keyword arguments every chat render gets",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='the engines\' flag of that name: tool_choice "none" renders the prompt without the tools',
    )


def _default_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return kwargs


def special_tokens(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens from tokenizer_config.json (a token is its text, or an added-token object
    with `content`); a config without `added_tokens_decoder` takes special_tokens_map.json's over it, as
    transformers does for those older folders."""
    merged = dict(config)
    if "added_tokens_decoder" not in config:
        merged.update(_read_json(folder / "special_tokens_map.json"))
    names: list[str] = list(SPECIAL_TOKEN_NAMES)
    extra = merged.get("extra_special_tokens")
    if isinstance(extra, dict):  # named model-specific tokens (e.g. image_token)
        merged.update(extra)
        names += [n for n in extra if n not in names]
    out = {}
    for name in names:
        value = merged.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the engine hands them to the template (protocol.ChatMessage.as_template_dict): text
    parts (and an assistant's refusal parts) joined, developer as system, a missing content as "", name, tool_call_id and tool calls (their
    JSON arguments parsed) where set, an assistant turn's `reasoning` (or `reasoning_content`) under both
    names. A message the engine refuses is Unrenderable("bad_request")."""
    if not isinstance(messages, list) or not messages:
        raise Unrenderable("bad_request", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise Unrenderable("bad_request", f"messages[{i}] has no role the engine takes")
        content = m.get("content")
        if isinstance(content, list):
            texts = [_part_text(p) for p in content]
            if any(t is None for t in texts):
                raise Unrenderable("bad_request", f"messages[{i}].content has a part that is not text")
            content = "".join(t for t in texts if t is not None)
        elif content is not None and not isinstance(content, str):
            raise Unrenderable("bad_request", f"messages[{i}].content is neither text nor parts")
        message: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        message["content"] = content or ""
        name, call_id, calls = m.get("name"), m.get("tool_call_id"), m.get("tool_calls")
        if not all(v is None or isinstance(v, str) for v in (name, call_id)):
            raise Unrenderable("bad_request", f"messages[{i}].name or tool_call_id is not text")
        if name:
            message["name"] = name
        if call_id is not None:
            message["tool_call_id"] = call_id
        if calls:
            message["tool_calls"] = _tool_calls(calls, i)
        said = (m.get("reasoning"), m.get("reasoning_content"))
        if not all(v is None or isinstance(v, str) for v in said):
            raise Unrenderable("bad_request", f"messages[{i}].reasoning or reasoning_content is not text")
        reasoning = said[0] if said[0] is not None else said[1]
        if m["role"] == "assistant" and reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        out.append(message)
    return out


def _part_text(part: Any) -> str | None:
    """A content part's text as protocol.TextPart / RefusalPart read it; None for a part the engine refuses."""
    if not isinstance(part, dict):
        return None
    key = "refusal" if part.get("type") == "refusal" else "text"
    if part.get("type") not in ("text", "input_text", "output_text", "refusal"):
        return None
    value = part.get(key)
    return value if isinstance(value, str) else None


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as tools.template_tool_calls writes them: JSON arguments parsed."""
    if not isinstance(calls, list):
        raise Unrenderable("bad_request", f"messages[{i}].tool_calls is not a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(call.get("id"), str)
            and call.get("type", "function") in ("function", None)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise Unrenderable("bad_request", f"messages[{i}].tool_calls has a call the engine refuses")
        try:
            arguments: Any = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = function["arguments"]
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools as the engine passes them (tool_models.ChatTool dumped without its unset fields): `type`
    then `function` (name, description, parameters, strict, then any other keys as sent), then any other
    keys as sent; keys whose value is null are left out at those two levels, kept deeper down."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise Unrenderable("bad_request", "tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Unrenderable("bad_request", f"tools[{i}] has no function name")
        if tool.get("type") not in (None, "function"):
            raise Unrenderable("bad_request", f"tools[{i}].type is not function")
        dumped: dict[str, Any] = {"type": "function", "function": _declared_first(function, _FUNCTION_FIELDS)}
        dumped.update((k, v) for k, v in tool.items() if k not in ("type", "function") and v is not None)
        out.append(dumped)
    return out


_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")  # tool_models.FunctionDefinition's order


def _declared_first(obj: Mapping[str, Any], declared: tuple[str, ...]) -> dict[str, Any]:
    """A pydantic model's dump of `obj`: its declared fields in their order, then the others as sent,
    without null values."""
    out = {k: obj[k] for k in declared if obj.get(k) is not None}
    out.update((k, v) for k, v in obj.items() if k not in declared and v is not None)
    return out


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean field (null means the default, as the engine reads it); any other type is the engine's 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Unrenderable("bad_request", f"{name} is not a boolean")
    return value


def _tag_final_message(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """continue_final_message, as transformers does it: the final message's content is tagged, so that the
    rendered text can be cut where that content ends (the template's end-of-turn dropped)."""
    if "content" not in source:
        raise Unrenderable(
            "bad_request", "continue_final_message: the template never reads a message's content"
        )
    tagged = [dict(m) for m in messages]
    tagged[-1]["content"] = tagged[-1]["content"] + CONTINUE_TAG
    return tagged


def _cut_at_tag(text: str, tagged_content: str) -> str:
    final = tagged_content.removesuffix(CONTINUE_TAG)
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise Unrenderable("template_error", "continue_final_message: the template dropped the final message")
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space: so is the tag's


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _environment() -> Any:
    """transformers' chat template environment: jinja2's immutable sandbox with trim_blocks and
    lstrip_blocks, loop controls, the `{% generation %}` tag (which renders its body: it only marks the
    assistant's tokens for training), `tojson` without HTML escaping, `raise_exception`, `strftime_now`, and
    a `namespace` that refuses underscore names."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with _: {name!r}")
            super().__setitem__(name, value)

    def namespace(*args: Any, **kwargs: Any) -> Namespace:
        attrs = dict(*args, **kwargs)
        bad = [n for n in attrs if isinstance(n, str) and n.startswith("_")]
        if bad:
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with _: {bad[0]!r}")
        return Namespace(attrs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = namespace
    return env
