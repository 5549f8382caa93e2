"""vLLM's utility routes: POST /tokenize, POST /detokenize, GET /version, with vLLM's bodies.

`/tokenize` takes `{"prompt": ...}` (tokenized as completions would, `add_special_tokens` true by default)
or `{"messages": [...]}` (through the chat template as chat completions would, with the same template
controls: `add_generation_prompt`, `continue_final_message`, `chat_template`, `chat_template_kwargs`,
`documents`, `tools`, `add_special_tokens` default false) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes `{"tokens": [...]}` and answers
`{"prompt": text}`; `/version` answers `{"version": ...}`, specfleet's package version.
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from . import chat as chat_template
from .errors import APIError
from .lenient import LenientModel
from .protocol import MAX_TOOLS, ChatMessage
from .state import ServerState, get_state
from .tool_models import ChatTool

router = APIRouter()


class TokenizeCompletionRequest(LenientModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(LenientModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(LenientModel):
    model: str | None = None
    tokens: list[int]


def _parse(model: type[BaseModel], body: Any) -> Any:
    """The body as `model`, or the same 400 naming the field that a route's own body gets."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc


def _checked(state: ServerState, body: LenientModel) -> None:
    state.check_model(getattr(body, "model", None))
    refused = body.refused_field()
    if refused is not None:
        raise APIError(400, refused[1], refused[0], "unsupported_value")


@router.post("/tokenize")
async def tokenize(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    state = get_state(request)
    if "messages" in body:
        chat = _parse(TokenizeChatRequest, body)
        _checked(state, chat)
        ids = chat_template.render_with(state.chat, state.tokenizer, chat, chat.tools).prompt_ids
        want_strs = chat.return_token_strs
    else:
        plain = _parse(TokenizeCompletionRequest, body)
        _checked(state, plain)
        ids = list(state.tokenizer.encode(plain.prompt, add_special_tokens=plain.add_special_tokens))
        want_strs = plain.return_token_strs
    return {
        "count": len(ids),
        "max_model_len": state.max_model_len,
        "tokens": ids,
        "token_strs": list(state.tokenizer.convert_ids_to_tokens(ids)) if want_strs else None,
    }


@router.post("/detokenize")
async def detokenize(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    state = get_state(request)
    parsed = _parse(DetokenizeRequest, body)
    _checked(state, parsed)
    bad = [t for t in parsed.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(
            400,
            f"tokens contains {bad[0]}: token ids must be in [0, {state.vocab_size})",
            "tokens",
            "invalid_value",
        )
    return {"prompt": state.tokenizer.decode(parsed.tokens)}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": importlib.metadata.version("specfleet")}
