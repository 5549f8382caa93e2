"""A chat request's path around the engine: the prompt through the chat template (tools, tool calls, tool
results, `chat_template_kwargs`), the grammar its tool choice needs, and the output read back into an OpenAI
message (reasoning, content, tool calls), whole or as stream deltas.

The server's options (`--chat-template`, `--enable-auto-tool-choice`, `--tool-call-parser`,
`--reasoning-parser`) are one frozen `ChatOptions`, checked when the server starts."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specfleet.engine.detokenizer import TokenText
from specfleet.engine.outputs import CompletionOutput, RequestOutput
from specfleet.engine.sampling_params import SamplingParams

from . import serving
from .errors import APIError
from .reasoning import END, ReasoningParser, get_reasoning_parser
from .tool_parsers import ToolParser, get_tool_parser
from .tools import PartialCall, ToolPlan, new_call_id, plan_tools, required_calls, template_tools

log = logging.getLogger("specfleet.engine.server")

# The name templates see the conversation under: never a chat_template_kwargs key (reserved_kwargs).
CONVERSATION_NAMES = frozenset({"messages", "conversation"})


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None  # the text of --chat-template (None: the model's own)
    tool_parser: ToolParser | None = None  # set only with --enable-auto-tool-choice
    reasoning_parser: ReasoningParser | None = None
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    exclude_tools_when_none: bool = False  # tool_choice "none" renders the prompt without the tools
    trust_request_chat_template: bool = False  # a request's own `chat_template` runs only with this flag

    @classmethod
    def from_flags(
        cls,
        chat_template: str | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        default_chat_template_kwargs: str | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        trust_request_chat_template: bool = False,
    ) -> ChatOptions:
        """ValueError naming the flag for a bad value: the server refuses to start."""
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, ...)")
        if tool_call_parser is not None and not enable_auto_tool_choice:
            raise ValueError("--tool-call-parser is used only with --enable-auto-tool-choice; add it")
        template = None
        if chat_template is not None:
            path = Path(chat_template)
            if not path.is_file():
                raise ValueError(f"--chat-template {chat_template!r} is not a file (a Jinja chat template)")
            template = path.read_text(encoding="utf-8")
        kwargs: Any = {}
        if default_chat_template_kwargs:
            try:
                kwargs = json.loads(default_chat_template_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
            if not isinstance(kwargs, dict):
                raise ValueError("--default-chat-template-kwargs must be a JSON object")
        return cls(
            chat_template=template,
            tool_parser=get_tool_parser(tool_call_parser) if tool_call_parser else None,
            reasoning_parser=get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
            default_template_kwargs=kwargs,
            exclude_tools_when_none=exclude_tools_when_tool_choice_none,
            trust_request_chat_template=trust_request_chat_template,
        )


@dataclass
class Rendered:
    prompt_ids: list[int]
    prompt_text: str


def render(options: ChatOptions, tokenizer: Any, body: Any, plan: ChatPlan) -> Rendered:
    """The prompt: the conversation through the chat template with the tools and template kwargs."""
    tools = None if plan.tools.choice == "none" and options.exclude_tools_when_none else body.tools
    return render_with(options, tokenizer, body, tools)


def render_with(options: ChatOptions, tokenizer: Any, body: Any, tools: Any) -> Rendered:
    """`render` for any body with the chat template controls (chat completions', /tokenize's), as vLLM's:
    `add_generation_prompt` opens the answer's turn, `continue_final_message` leaves the last message open
    (no end of turn) for the model to continue, `documents` reach the template, a request's `chat_template`
    replaces the server's when --trust-request-chat-template allows it, and `add_special_tokens` adds the
    tokenizer's BOS and the like to what the template wrote."""
    if body.continue_final_message and body.add_generation_prompt:  # vLLM refuses both too
        raise APIError(
            400,
            "continue_final_message=true continues the last message and add_generation_prompt=true (the "
            "default) starts a new one: send add_generation_prompt=false with it",
            "continue_final_message",
            "invalid_value",
        )
    if body.chat_template is not None and not options.trust_request_chat_template:
        raise APIError(  # vLLM's gate: a template is code the server runs (Jinja, sandboxed or not)
            400,
            "chat_template is passed with the request, but the server was not started with "
            "--trust-request-chat-template; leave it out to use the server's template",
            "chat_template",
            "invalid_value",
        )
    template_kwargs = {**options.default_template_kwargs, **(body.chat_template_kwargs or {})}
    reserved = sorted(reserved_kwargs(type(tokenizer)) & set(template_kwargs))
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server passes them itself",
            f"chat_template_kwargs.{reserved[0]}",
            "invalid_value",
        )
    template = body.chat_template if body.chat_template is not None else options.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "the model has no chat template; use /v1/completions, or start the server with --chat-template",
            "messages",
            "invalid_value",
        )
    template_kwargs.setdefault("add_generation_prompt", body.add_generation_prompt)
    try:
        text = tokenizer.apply_chat_template(
            [m.as_template_dict() for m in body.messages],
            tools=template_tools(tools),
            documents=body.documents,
            chat_template=template,
            continue_final_message=body.continue_final_message,
            tokenize=False,
            **template_kwargs,
        )
    except Exception as exc:
        raise APIError(
            400,
            f"messages cannot be rendered with the chat template: {type(exc).__name__}: {exc}",
            "messages",
            "invalid_value",
        ) from exc
    if not isinstance(text, str):  # a template kwarg that changed what comes back: not ours to guess
        raise APIError(400, "the chat template did not render text", "chat_template_kwargs", "invalid_value")
    return Rendered(list(tokenizer.encode(text, add_special_tokens=body.add_special_tokens)), text)


def reserved_kwargs(tokenizer_class: Any) -> frozenset[str]:
    """The names chat_template_kwargs may not set: the tokenizer's `apply_chat_template` parameters (the
    conversation, tools, template, padding, how the result comes back: the server's to pass), read from its
    signature, except add_generation_prompt; and the conversation's names."""
    reserved = _RESERVED.get(tokenizer_class)
    if reserved is None:
        parameters = inspect.signature(tokenizer_class.apply_chat_template).parameters.items()
        own = {n for n, p in parameters if p.kind is not p.VAR_KEYWORD and n != "add_generation_prompt"}
        reserved = _RESERVED[tokenizer_class] = frozenset(own - {"self"}) | CONVERSATION_NAMES
    return reserved


_RESERVED: dict[Any, frozenset[str]] = {}  # reserved_kwargs per tokenizer class (a signature read once)


@dataclass
class ChatPlan:
    """How one chat request's output is constrained and read back."""

    tools: ToolPlan
    schemas: dict[str, Any]  # tool name -> its parameters' schema (qwen3_xml types values by it)
    tool_parser: ToolParser | None
    reasoning: ReasoningParser | None
    include_reasoning: bool = True
    reasoning_closed: bool = False  # the prompt closed the reasoning (set by `apply`): all output is answer
    # the ids of the server's parser (Mistral's templates want 9 characters), else vLLM's
    new_call_id: Callable[[], str] = new_call_id

    @property
    def shaped(self) -> bool:
        """Whether the output needs reading (tools or reasoning); a plain request keeps the plain path."""
        return self.tools.choice != "none" or self.reasoning is not None


def plan(options: ChatOptions, body: Any) -> ChatPlan:
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, _auto_name(options))
    schemas = {t.function.name: t.function.parameters or {} for t in body.tools or []}
    return ChatPlan(
        tools,
        schemas,
        options.tool_parser if tools.choice == "auto" else None,
        options.reasoning_parser,
        body.include_reasoning is not False,
        new_call_id=options.tool_parser.call_id if options.tool_parser is not None else new_call_id,
    )


def _auto_name(options: ChatOptions) -> str | None:
    return options.tool_parser.name if options.tool_parser is not None else None


def apply(plan: ChatPlan, params: SamplingParams, rendered: Rendered, tokenizer: Any) -> None:
    """The plan's changes to the request's sampling: the tool grammar, special tokens kept for a parser
    whose markers are special tokens, and where a grammar starts when the model reasons first."""
    if plan.tools.spec is not None:
        if params.structured_outputs is not None:
            raise APIError(
                400,
                f"tool_choice={plan.tools.choice!r} constrains the output to tool calls; a structured-output "
                f"field ({params.structured_outputs.source}) cannot constrain it too: keep one",
                "tool_choice",
                "invalid_value",
            )
        params.structured_outputs = plan.tools.spec
    if plan.tool_parser is not None and plan.tool_parser.keep_special_tokens:
        params.skip_special_tokens = False
    if plan.reasoning is None:
        return
    plan.reasoning_closed = not plan.reasoning.starts_in_reasoning(rendered.prompt_text)
    if params.structured_outputs is not None and not plan.reasoning_closed:
        params.reasoning_end_token_ids = list(tokenizer.encode(END, add_special_tokens=False))


@dataclass
class _Read:
    """An output read as far as it can be told apart."""

    reasoning: str | None
    content: str | None
    calls: list[PartialCall]


@dataclass
class _Sent:
    reasoning: int = 0
    content: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)  # (id, characters of arguments sent)


class ChatShape:
    """Messages and stream deltas of one request under its plan; holds the tool-call ids so that a stream's
    chunks and its calls agree."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self._sent: dict[int, _Sent] = {}

    def read(self, text: str, final: bool) -> _Read:
        plan = self.plan
        reasoning, answer, ended = None, text, True
        if plan.reasoning is not None and not plan.reasoning_closed:
            split = plan.reasoning.split(text, final)
            reasoning, answer, ended = split.reasoning, split.content, split.ended
        if not plan.include_reasoning:
            reasoning = None
        choice = plan.tools.choice
        if choice == "none" or not ended:
            return _Read(reasoning, answer if ended else "", [])
        if choice == "named":
            assert plan.tools.name is not None, "a named choice has its name"
            started = bool(answer.strip()) or final
            return _Read(reasoning, None, [PartialCall(plan.tools.name, answer, final)] if started else [])
        if choice == "required":
            calls = required_calls(answer)
            if calls is None or (final and not all(c.done for c in calls)):
                return _Read(reasoning, answer if final else "", [] if calls is None else calls)
            return _Read(reasoning, None, calls)
        assert plan.tool_parser is not None, "auto has its parser (plan_tools refuses it otherwise)"
        try:
            parsed = plan.tool_parser.parse(answer, final, plan.schemas)
        except Exception:  # a parser's bug must not fail the request: the text is the answer
            log.exception("event=tool_parser_failed parser=%s", plan.tool_parser.name)
            return _Read(reasoning, answer, [])
        calls = [PartialCall(name, arguments, True) for name, arguments in parsed.calls]
        if plan.tools.one_call:
            calls = calls[:1]
        return _Read(reasoning, parsed.content if parsed.content or not calls else None, calls)

    def finish_reason(self, out: CompletionOutput, read: _Read) -> str | None:
        if out.finish_reason == "stop" and read.calls and self.plan.tools.choice in ("auto", "required"):
            return "tool_calls"
        return out.finish_reason

    def message(self, out: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        read = self.read(out.text, True)
        sent = self._sent.setdefault(out.index, _Sent())
        content = read.content if read.content or self.plan.reasoning is None else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if read.calls:
            message["tool_calls"] = [
                {
                    "id": self._call_id(sent, i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(read.calls)
            ]
        self._reasoning(message, read.reasoning)
        return message, self.finish_reason(out, read)

    def _reasoning(self, target: dict[str, Any], reasoning: str | None) -> None:
        """vLLM renamed `reasoning_content` to `reasoning` and then dropped the old name, which broke
        clients that read it (LiteLLM, LangChain read `reasoning_content`): both are sent."""
        if self.plan.reasoning is not None and self.plan.include_reasoning:
            target["reasoning_content"] = target["reasoning"] = reasoning

    def _call_id(self, sent: _Sent, i: int) -> str:
        while len(sent.calls) <= i:
            sent.calls.append((self.plan.new_call_id(), 0))
        return sent.calls[i][0]

    def delta(
        self,
        out: CompletionOutput,
        cursor: serving.ChoiceCursor,
        index: int,
        num_logprobs: int | None,
        text: TokenText,
    ) -> dict[str, Any] | None:
        """The next stream chunk's choice, as OpenAI sends tool calls: the first delta of a call carries its
        index, id, type, name and empty arguments, the next ones only argument fragments."""
        read = self.read(out.text, out.finished)
        sent = self._sent.setdefault(out.index, _Sent())
        delta: dict[str, Any] = {}
        if not cursor.started:
            delta["role"] = "assistant"
        if read.reasoning is not None and len(read.reasoning) > sent.reasoning:
            self._reasoning(delta, read.reasoning[sent.reasoning :])
            sent.reasoning = len(read.reasoning)
        if read.content and len(read.content) > sent.content:
            delta["content"] = read.content[sent.content :]
            sent.content = len(read.content)
        calls = []
        for i, call in enumerate(read.calls):
            new = i >= len(sent.calls)
            call_id = self._call_id(sent, i)
            done = sent.calls[i][1]
            if new:  # one entry per call and chunk: its header, with what arguments there are yet
                function = {"name": call.name, "arguments": call.arguments}
                calls.append({"index": i, "id": call_id, "type": "function", "function": function})
            elif len(call.arguments) > done:
                calls.append({"index": i, "function": {"arguments": call.arguments[done:]}})
            sent.calls[i] = (call_id, len(call.arguments))
        if calls:
            delta["tool_calls"] = calls
        new_logprobs = (out.logprobs or [])[cursor.num_logprobs :] if num_logprobs is not None else []
        finishing = out.finished and not cursor.done
        if not delta and not new_logprobs and not finishing:
            return None
        cursor.started = True
        if "role" in delta and "content" not in delta:
            delta["content"] = "" if not calls else None
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if num_logprobs is not None:
            choice["logprobs"] = serving.chat_logprobs(new_logprobs, text, num_logprobs)
            cursor.num_logprobs += len(new_logprobs)
        cursor.text_len = len(out.text)
        if out.finished:
            choice["finish_reason"] = self.finish_reason(out, read)
            choice["stop_reason"] = out.stop_reason  # as the plain chat stream sends it (serving.chat_delta)
            cursor.done = True
        return choice


def choices(
    shape: ChatShape | None, plain: list[dict[str, Any]], final: RequestOutput
) -> list[dict[str, Any]]:
    """The response's choices: the plain ones, with each message and finish_reason read under the plan."""
    if shape is None:
        return plain
    outputs = {out.index: out for out in final.outputs}
    for choice in plain:
        choice["message"], choice["finish_reason"] = shape.message(outputs[choice["index"]])
    return plain


def echo_prefix(body: Any) -> str:
    """Chat `echo`, as vLLM's: the last message's content when it is the answering role's (the assistant's
    with add_generation_prompt, else whichever role spoke last), to put before the answer; else ""."""
    if not body.echo:
        return ""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    if last.role != role:
        return ""
    content = last.content
    if isinstance(content, list):  # vLLM joins text parts with newlines here
        return "\n".join(part.shown for part in content)
    return content or ""


def echoed(choices: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """Whole responses' choices with the echoed prefix before each message's content."""
    if prefix:
        for choice in choices:
            choice["message"]["content"] = prefix + (choice["message"].get("content") or "")
    return choices


def echo_delta(prefix: str, n: int) -> list[dict[str, Any]]:
    """A stream's first choices with echo: the prefix as each choice's first content delta."""
    delta = {"role": "assistant", "content": prefix}
    return [{"index": i, "delta": dict(delta), "logprobs": None, "finish_reason": None} for i in range(n)]
