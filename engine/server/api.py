"""OpenAI routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models and /v1/models/{model}."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from specfleet.engine.core.client import EngineDeadError, EngineInternalError, QueueFullError
from specfleet.engine.errors import context_length_error
from specfleet.engine.outputs import RequestOutput
from specfleet.engine.sampling_params import ParameterError, SamplingParams

from . import chat, remote_prefill, resume, serving, tracing
from .errors import APIError, error_body
from .lenient import shown_name
from .protocol import ALL_LOGPROBS, MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, SamplingFields
from .request_ids import request_id
from .state import ServerState, get_state
from .streams import RequestStream

logger = logging.getLogger("specfleet.engine.server")
router = APIRouter()
QUEUE_RETRY_AFTER_S = 1
# A dead engine core: the server exits and its pod restarts (tens of seconds); a router retries elsewhere at once.
ENGINE_DEAD_RETRY_AFTER_S = 5
DISCONNECT_POLL_S = 0.25


def _check_fields(state: ServerState, body: SamplingFields, route: str) -> None:
    """vLLM's leniency (lenient.py): a field asking for what is not implemented is a 400 naming it; other
    unknown fields are ignored, each name logged once and every request counted."""
    refused = body.refused_field()
    if refused is not None:
        raise APIError(400, refused[1], refused[0], "unsupported_value")
    for field in map(shown_name, body.ignored_fields()):
        if state.metrics.ignore_field(field):
            logger.warning(
                "event=ignored_request_field field=%s route=%s the field is accepted and ignored "
                "(logged once per field name; counted in specfleet_ignored_request_fields_total)",
                field,
                route,
            )


def _check_token_ids(body: SamplingFields) -> None:
    if body.return_token_ids and body.stream:
        raise APIError(
            400,
            "return_token_ids is answered on non-streamed requests only; send stream=false or leave it out",
            "return_token_ids",
            "unsupported_value",
        )


def _with_token_ids(
    body: SamplingFields, finals: list[RequestOutput], answer: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's return_token_ids: each choice's `token_ids`, and the prompt's `prompt_token_ids` (per choice in
    completions, where each prompt has its own; at the top of a chat response)."""
    if not body.return_token_ids:
        return answer
    n = body.n
    for choice in answer["choices"]:
        final = finals[choice["index"] // n]
        out = next(o for o in final.outputs if o.index == choice["index"] % n)
        choice["token_ids"] = list(out.token_ids)
        if not isinstance(body, ChatCompletionRequest):
            choice["prompt_token_ids"] = list(final.prompt_token_ids)
    if isinstance(body, ChatCompletionRequest):
        answer["prompt_token_ids"] = list(finals[0].prompt_token_ids)
    return answer


def _check_all_logprobs(state: ServerState, body: SamplingFields) -> None:
    """-1 asks for the whole vocabulary, which vLLM (at its default --max-logprobs 20) refuses too."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(body, name, None)
        if value == ALL_LOGPROBS and not isinstance(value, bool):
            raise APIError(
                400,
                f"{name}=-1 asks for the whole vocabulary: requested logprobs of {state.vocab_size}, which is "
                f"greater than max allowed: {MAX_LOGPROBS}",
                name,
                "invalid_value",
            )


def _sampling_params(
    state: ServerState, body: SamplingFields, prompt_lens: list[int | None]
) -> SamplingParams:
    _check_all_logprobs(state, body)
    _check_token_ids(body)
    try:
        params = body.to_sampling_params(state.engine.sampling_defaults)
    except ParameterError as exc:  # a StructuredOutputError too: it names the field it is about
        raise APIError(400, str(exc), exc.param, exc.code) from exc
    except ValueError as exc:
        raise APIError(400, str(exc), None, "invalid_value") from exc
    bad = [t for t in params.stop_token_ids if t >= state.vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids contains {bad[0]}: token ids must be in [0, {state.vocab_size})",
            "stop_token_ids",
            "invalid_value",
        )
    limit = state.max_model_len
    chat = isinstance(body, ChatCompletionRequest)
    what = "messages" if chat else "prompt"
    for length in prompt_lens:
        if length is not None and length >= limit:
            shown = "your messages (with the chat template) have" if chat else "your prompt has"
            raise _context_error(
                context_length_error(
                    what,
                    limit,
                    f"{shown} {length} tokens, which leaves no room for a generated token. "
                    f"Please reduce the length of the {what}.",
                )
            )
        if params.max_tokens is not None and params.max_tokens > limit - (length or 0):
            field, wanted = _max_tokens_field(body), params.max_tokens
            asked = (
                f"you requested {length + wanted} tokens ({length} in the {what}, {field}={wanted} in the "
                f"completion). Please reduce the length of the {what} or {field}."
                if length
                else f"{field}={wanted} asks for more. Please reduce {field}."
            )
            raise _context_error(context_length_error(field, limit, asked))
    return params


def _context_error(exc: ParameterError) -> APIError:
    return APIError(400, str(exc), exc.param, exc.code)


def _max_tokens_field(body: SamplingFields) -> str:
    """The field that set the completion's length, as the request spelled it (a chat request's
    `max_completion_tokens` wins over its deprecated `max_tokens`)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


async def _submit(
    state: ServerState,
    ids: list[str],
    prompts: list[Any],
    params: SamplingParams,
    prompt_param: str,
    kv_transfer_params: dict[str, Any] | None = None,
    priority: int = 0,
    trace: tracing.RequestTrace | None = None,
    lora_name: str | None = None,
) -> list[RequestStream]:
    if kv_transfer_params and len(prompts) != 1:
        raise APIError(
            400,
            f"kv_transfer_params needs exactly one prompt, got {len(prompts)}",
            "kv_transfer_params",
            "invalid_value",
        )
    in_flight = getattr(state.async_engine, "streams", {})
    for rid in ids:
        if rid in in_flight:
            raise APIError(
                400,
                f"request id {rid!r} is already in use by a request in flight; send a unique request_id "
                "or X-Request-Id",
                "request_id",
                "invalid_value",
            )
    streams: list[RequestStream] = []
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            streams.append(
                await state.async_engine.generate(
                    rid, prompt, params, kv_transfer_params, priority, trace=trace, lora_name=lora_name
                )
            )
    except EngineDeadError as exc:
        _close(streams)
        raise engine_dead(exc) from exc
    except EngineInternalError as exc:
        _close(streams)
        raise APIError(500, f"the engine failed to add the request: {exc}", code="internal_error") from exc
    except QueueFullError as exc:
        _close(streams)
        state.metrics.refuse("queue_full")
        raise APIError(
            429, f"{exc}; retry later", code="queue_full", headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)}
        ) from exc
    except ParameterError as exc:
        _close(streams)
        raise APIError(400, str(exc), prompt_param if exc.param == "prompt" else exc.param, exc.code) from exc
    except ValueError as exc:
        _close(streams)
        raise APIError(400, str(exc), prompt_param, "invalid_value") from exc
    except BaseException:
        _close(streams)
        raise
    return streams


def engine_dead(exc: EngineDeadError) -> APIError:
    """503 + Retry-After for a request the engine core's death ended, before or after it started: not the
    request's fault and not a 500, so a router can tell "retry on another replica" from a bug."""
    return APIError(
        503,
        f"the engine is down ({exc}); retry on another replica",
        code="engine_dead",
        headers={"Retry-After": str(ENGINE_DEAD_RETRY_AFTER_S)},
    )


def _close(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _final(stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    try:
        async for output in stream:
            last = output
    except EngineDeadError as exc:
        raise engine_dead(exc) from exc
    if last is None or not last.finished:
        raise APIError(
            503,
            "the request was aborted before it finished (server draining)",
            code="aborted",
            headers={"Retry-After": "5"},
        )
    return last


async def _collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """All final outputs; aborts everything if the client disconnects while waiting."""
    task = asyncio.ensure_future(asyncio.gather(*(_final(s) for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.add_done_callback(_consume)
                task.cancel()
                raise APIError(499, "client disconnected", code="client_closed_request")
    finally:
        if not task.done():
            task.add_done_callback(_consume)
            task.cancel()
        _close(streams)


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except BaseException as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _chunk(
    kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]], include_usage: bool
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


async def _stream_body(
    state: ServerState,
    streams: list[RequestStream],
    rid: str,
    chat: bool,
    n: int,
    include_usage: bool,
    logprobs: int | None,
    continuous_usage: bool = False,
    echo: bool = False,
    shape: chat.ChatShape | None = None,
    model: str | None = None,  # the name the request used: the served model's, or a LoRA adapter's
    resumed: resume.Resume | None = None,  # the request continues another engine's stream
    token_ids: bool = False,  # each choice carries its new output token ids (server/resume.py)
) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    created, model = int(time.time()), model or state.model_name
    text = serving.TokenText(state.tokenizer)
    cursors = serving.StreamState(first=resumed.cursor if resumed is not None else None)
    finals: dict[int, RequestOutput] = {}
    try:
        async for p, output in _merge(streams):
            finals[p] = output
            choices = []
            for out in sorted(output.outputs, key=lambda o: o.index):
                index = p * n + out.index
                cursor = cursors.cursor(index, output.prompt_token_ids)
                choice = (
                    (shape.delta if shape is not None else serving.chat_delta)(
                        out, cursor, index, logprobs, text
                    )
                    if chat
                    else serving.completion_delta(
                        out,
                        cursor,
                        index,
                        logprobs is not None,
                        text,
                        serving.Echo.of(output, text) if echo and not cursor.started else None,
                    )
                )
                if choice is not None:
                    if token_ids:
                        resume.add_token_ids(choice, out, cursor)
                    choices.append(choice)
            if choices:
                chunk = _chunk(kind, rid, created, model, choices, include_usage)
                if continuous_usage:
                    chunk["usage"] = serving.usage([finals[i] for i in sorted(finals)])
                yield serving.sse(chunk)
        cut = [i for i in range(len(streams) * n) if not cursors.cursor(i).done]
        if cut:  # aborted (drain timeout): say so instead of ending silently
            empty: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
            yield serving.sse(
                _chunk(
                    kind,
                    rid,
                    created,
                    model,
                    [{"index": i, **empty, "logprobs": None, "finish_reason": "abort"} for i in cut],
                    include_usage,
                )
            )
        if include_usage and finals:
            yield serving.sse(
                {
                    **_chunk(kind, rid, created, model, [], False),
                    "usage": serving.usage([finals[p] for p in sorted(finals)]),
                }
            )
    except EngineDeadError as exc:  # the same body a non-streamed request gets with its 503
        dead = engine_dead(exc)
        yield serving.sse(error_body(dead.status, dead.message, None, dead.code))
    except Exception as exc:
        yield serving.sse(
            error_body(500, f"generation failed: {type(exc).__name__}: {exc}", None, "engine_error")
        )
    finally:
        _close(streams)
    yield serving.SSE_DONE


def _streaming_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    state.check_accepting()
    lora = state.check_model(body.model)
    _check_fields(state, body, "/v1/completions")
    resume.check(body)
    prompts = body.prompts()
    if not body.add_special_tokens:  # the engine would add BOS to text; token ids go in as they are
        prompts = [
            p if isinstance(p, list) else state.tokenizer.encode(p, add_special_tokens=False) for p in prompts
        ]
    params = _sampling_params(state, body, [len(p) if isinstance(p, list) else None for p in prompts])
    rid = f"cmpl-{request_id(request, body.request_id)}"
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    held = await remote_prefill.prefill(state.remote_prefill, request, "completions")
    kv_params = held or body.kv_transfer_params
    trace = tracing.start(state.async_engine.tracer, request.headers, "text_completion", params, kv_params)
    with remote_prefill.released_unless_taken(held):
        streams = await _submit(state, ids, prompts, params, "prompt", kv_params, body.priority, trace, lora)
    if body.stream and not body.scoring:
        return _streaming_response(
            _stream_body(
                state,
                streams,
                rid,
                False,
                body.n,
                body.include_usage,
                body.logprobs,
                body.continuous_usage,
                body.echo,
                model=lora,
                resumed=resume.Resume.of(state.tokenizer, params),
                token_ids=resume.wants_token_ids(request.headers),
            )
        )
    finals = await _collect(request, streams)
    text = serving.TokenText(state.tokenizer)
    answer = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": lora or state.model_name,
        "choices": serving.completion_choices(
            finals, body.n, body.logprobs is not None, text, body.echo, body.scoring
        ),
        "usage": serving.usage(finals),
        **_kv_transfer(finals),
    }
    if body.stream:  # scoring streamed: the whole answer is one chunk, as vLLM sends the prompt at once
        return _streaming_response(_scoring_stream(answer, body.include_usage))
    return _respond(body, finals, answer)


async def _scoring_stream(answer: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    usage = answer.pop("usage")
    yield serving.sse({**answer, **({"usage": None} if include_usage else {})})
    if include_usage:
        yield serving.sse({**answer, "choices": [], "usage": usage})
    yield serving.SSE_DONE


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    state.check_accepting()
    lora = state.check_model(body.model)
    _check_fields(state, body, "/v1/chat/completions")
    plan = chat.plan(state.chat, body)  # tools and reasoning: checked before the template renders them
    rendered = chat.render(state.chat, state.tokenizer, body, plan)
    prompt_ids = rendered.prompt_ids
    params = _sampling_params(state, body, [len(prompt_ids)])
    chat.apply(plan, params, rendered, state.tokenizer)
    shape = chat.ChatShape(plan) if plan.shaped else None
    resume.check(body, plan.shaped)
    rid = f"chatcmpl-{request_id(request, body.request_id)}"
    held = await remote_prefill.prefill(state.remote_prefill, request, "chat/completions")
    kv_params = held or body.kv_transfer_params
    trace = tracing.start(state.async_engine.tracer, request.headers, "chat", params, kv_params)
    with remote_prefill.released_unless_taken(held):
        streams = await _submit(
            state, [rid], [prompt_ids], params, "messages", kv_params, body.priority, trace, lora
        )
    num_logprobs = body.num_logprobs()
    echo = chat.echo_prefix(body)
    if body.stream:
        stream = _stream_body(
            state,
            streams,
            rid,
            True,
            body.n,
            body.include_usage,
            num_logprobs,
            body.continuous_usage,
            shape=shape,
            model=lora,
            resumed=resume.Resume.of(state.tokenizer, params),
            token_ids=resume.wants_token_ids(request.headers),
        )
        if echo and body.resume_token_ids is None:  # a resumed stream's client has had the echo
            first = _chunk(
                "chat.completion.chunk",
                rid,
                int(time.time()),
                lora or state.model_name,
                chat.echo_delta(echo, body.n),
                body.include_usage,
            )
            stream = _after(serving.sse(first), stream)
        return _streaming_response(stream)
    finals = await _collect(request, streams)
    text = serving.TokenText(state.tokenizer)
    return _respond(
        body,
        finals,
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": lora or state.model_name,
            "choices": chat.echoed(
                chat.choices(shape, serving.chat_choices(finals[0], num_logprobs, text), finals[0]), echo
            ),
            "usage": serving.usage(finals),
            **_kv_transfer(finals),
            **(
                {"prompt_logprobs": serving.prompt_logprobs_json(finals[0].prompt_logprobs)}
                if finals[0].prompt_logprobs is not None
                else {}
            ),
        },
    )


async def _after(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item


def _respond(body: SamplingFields, finals: list[RequestOutput], answer: dict[str, Any]) -> JSONResponse:
    return JSONResponse(_with_token_ids(body, finals, answer))


def _kv_transfer(finals: list[RequestOutput]) -> dict[str, Any]:
    """A prefill engine's answer names where the prompt's KV waits (vLLM's response field)."""
    params = finals[0].kv_transfer_params if len(finals) == 1 else None
    return {"kv_transfer_params": params} if params is not None else {}


def _model_cards(state: ServerState) -> list[dict[str, Any]]:
    """The base model's card, then each LoRA adapter's as vLLM lists them (parent: the base model, root: the
    adapter's path)."""
    base = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "specfleet",
        "max_model_len": state.max_model_len,
        "scheduling_policy": state.scheduling_policy,  # specfleet's: whether `priority` is taken
    }
    adapters = [
        {
            "id": name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "specfleet",
            "parent": state.model_name,
            "root": path,
            "max_model_len": state.max_model_len,
        }
        for name, path in state.lora_adapters.items()
    ]
    return [base, *adapters]


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _model_cards(get_state(request))}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> dict[str, Any]:
    """OpenAI's retrieve (`client.models.retrieve(name)`), which vLLM does not serve: one card of
    /v1/models, found by its id (a name with a slash arrives whole: the client sends it as %2F); any other
    name is the 404 `model_not_found` a request naming it gets."""
    state = get_state(request)
    cards = {card["id"]: card for card in _model_cards(state)}
    if model not in cards:
        state.check_model(model)  # the 404 that names the models served
    return cards[model]
