"""The gateway's tenant gate: every `/v1/...` request shows an API key, stays within its tenant's models and
quotas, and reaches the engine with its tenant's priority.

In order, for one request:
1. the key (`Authorization: Bearer KEY`) names a tenant, else 401 `invalid_api_key` (every path under
   /v1, `/v1/models` included; /health, /ready and /metrics stay open);
2. the model is one the tenant may call, else 403 `model_not_allowed` listing those it may;
3. the fields the accounting reads (`stream`, `n`, `max_tokens`, ...: TYPED_FIELDS) have their JSON
   types, else 400 `invalid_type` naming the field (the engine would coerce what the gate misread);
4. the request is charged one request and its estimated tokens (`estimate_tokens`), else 429 with
   `Retry-After` (or 429 `tokens_exceed_limit`, without it and with `x-should-retry: false`, when the
   estimate exceeds the whole limit);
5. the body the engine gets carries `priority` from the tenant's class (tenants.PRIORITY_CLASSES; a
   client's own `priority` is replaced; a service whose engines schedule fcfs gets none, since they refuse
   it), a stream asks for `stream_options.include_usage`, and the client's `Authorization` (the tenant's
   key) is not passed on;
6. at the end the tenant is charged the engine's reported usage instead of the estimate (usage_tap.py); an
   answer without usage keeps the estimate charged (or its prompt plus the text it streamed, when more:
   a stream cut before its usage), an error answer without usage is refunded.
Every response carries OpenAI's `x-ratelimit-*` headers for the tenant's limits. The metrics count
requests and tokens by tenant and result, the tenant being one of the configured names or `unknown`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from . import tracing
from .front import add_response_headers
from .proxy import DROP_AUTHORIZATION, RESPONSE_TAP, Answer, ClientRequest, Router, prompt_text
from .quota import Limiter, LocalLimiter, Verdict
from .tenants import UNKNOWN_TENANT, Tenant, TenantTable
from .usage_tap import UsageTap

logger = logging.getLogger("specfleet.router.tenants")

TENANT_KEY = web.RequestKey("specfleet_tenant", Tenant)
# Without the model's tokenizer a prompt is estimated at 4 bytes of UTF-8 per token: the usual figure for
# English with BPE vocabularies (OpenAI's tokenizer guide says ~4 characters); the end of the request
# charges the engine's real count, so the estimate only decides admission.
BYTES_PER_TOKEN = 4
OPEN_PATHS = ("/health", "/ready", "/metrics")
# The engine's routes that take `priority` (and, the first two, `stream_options`); other bodies (tokenize,
# detokenize) go on with only their model rewritten.
PRIORITY_PATHS = frozenset({"completions", "chat/completions", "embeddings"})
STREAM_PATHS = frozenset({"completions", "chat/completions"})
# The body fields the accounting reads, each with the JSON type it must have. The engine's schema coerces
# (`"stream": "true"` streams, `"n": "4"` is 4), so a value the gate read otherwise than the engine does
# would slip past the quota: a stream the gate took for a whole answer is not asked for its usage and is
# charged only the estimate. OpenAI's API refuses such values too (400 `invalid_type`).
TYPED_FIELDS: dict[str, type] = {
    "stream": bool,
    "stream_options": dict,
    "n": int,
    "best_of": int,
    "max_tokens": int,
    "max_completion_tokens": int,
}
JSON_TYPES: dict[type, str] = {bool: "a boolean", int: "an integer", dict: "an object"}
T = TypeVar("T")


def _error(
    status: int, message: str, kind: str, code: str, param: str | None = None, **headers: str
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers or None)


def prompt_tokens(body: dict[str, Any], encode: Callable[[str], list[int]] | None) -> tuple[int, int]:
    """The tokens of a request's prompts (by the model's tokenizer when the router has it, else
    BYTES_PER_TOKEN) and how many prompts it has (a batch's each get `n` choices of `max_tokens`)."""
    prompt = body.get("prompt", body.get("input"))  # `input`: embeddings
    texts: list[str] = []
    ids = 0
    prompts = 1
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts, prompts = list(prompt), len(prompt)  # a batch of prompts: each one is prefilled
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        ids, prompts = sum(len(p) for p in prompt), len(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        ids = len(prompt)  # one prompt as token ids (an embeddings `input` too)
    elif isinstance(prompt, str):
        texts = [prompt]
    else:
        text, token_ids = prompt_text(body)
        texts, ids = [text], len(token_ids or [])
    return ids + sum(text_tokens(text, encode) for text in texts), prompts


def text_tokens(text: str, encode: Callable[[str], list[int]] | None) -> int:
    if not text:
        return 0
    return len(encode(text)) if encode is not None else math.ceil(len(text.encode()) / BYTES_PER_TOKEN)


def estimate_tokens(body: dict[str, Any], encode: Callable[[str], list[int]] | None) -> int:
    """The tokens a request may use: its prompts' (prompt_tokens) plus completion_tokens."""
    tokens, prompts = prompt_tokens(body, encode)
    return tokens + completion_tokens(body, prompts)


def completion_tokens(body: dict[str, Any], prompts: int) -> int:
    """`max_tokens` (or `max_completion_tokens`) for each of the `n` choices of each of `prompts`; 0 when
    the body sets no limit."""
    limit = body.get("max_completion_tokens")
    if limit is None:  # the engine reads `max_tokens` when max_completion_tokens is absent or null
        limit = body.get("max_tokens")
    n = body.get("n")
    choices = n if isinstance(n, int) and n > 0 else 1
    return limit * choices * prompts if isinstance(limit, int) and limit > 0 else 0


def type_error(body: dict[str, Any]) -> tuple[str, str] | None:
    """The first field the accounting reads whose value is not of its JSON type: (the field, why); None
    when all are (or absent, or null: the engine's to judge)."""
    fields = [(name, body[name], kind) for name, kind in TYPED_FIELDS.items() if name in body]
    options = body.get("stream_options")
    if isinstance(options, dict) and "include_usage" in options:
        fields.append(("stream_options.include_usage", options["include_usage"], bool))
    for name, value, kind in fields:
        wrong = isinstance(value, bool) if kind is int else False  # JSON true is no integer
        if value is not None and (wrong or not isinstance(value, kind)):
            return name, f"`{name}` must be {JSON_TYPES[kind]}, not {json.dumps(value)[:40]}"
    return None


class TenantMetrics:
    def __init__(self) -> None:
        # result: ok (admitted), unauthorized (401), forbidden (403), invalid (400: a field of the wrong
        # type), rate_limited (429), too_large (429 without Retry-After); tenant: a configured tenant's name, or `unknown` for a missing or wrong key.
        self.requests = Counter(
            "specfleet_gateway_tenant_requests",
            "Requests by tenant and result",
            ["tenant", "result"],
            registry=None,
        )
        # ok: the tokens charged at the end (the engine's usage, else the estimate); the others: the estimate
        # of the requests refused.
        self.tokens = Counter(
            "specfleet_gateway_tenant_tokens",
            "Tokens (prompt and completion) by tenant and result",
            ["tenant", "result"],
            registry=None,
        )

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.requests)
        registry.register(self.tokens)


class TenantGate:
    def __init__(self, table: TenantTable, limiter: Limiter | None = None) -> None:
        self.table = table
        self.limiter: Limiter = limiter or LocalLimiter()
        self.metrics = TenantMetrics()
        self._settling: set[asyncio.Task[None]] = set()

    def install(self, app: web.Application, registry: CollectorRegistry) -> None:
        """The gate on the gateway's application: the key check before every handler but the open ones (the
        gateway checks the `/v1/...` requests the raw front hands it: Gateway.forward)."""
        app.middlewares.append(self.authenticate)
        app.on_cleanup.append(self._close)
        self.metrics.register(registry)

    async def _close(self, _: web.Application) -> None:
        """The settlements still running finish, then the limiter's connections (Redis) close."""
        await asyncio.gather(*self._settling, return_exceptions=True)
        close = getattr(self.limiter, "close", None)
        if close is not None:
            await close()

    @web.middleware
    async def authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        refused = self.identify(request)
        return refused if refused is not None else await handler(request)

    def identify(self, request: ClientRequest) -> web.Response | None:
        """The tenant whose key the request shows, kept on the request (TENANT_KEY, and the span's
        tracing.TENANT_KEY); else the 401 to answer. A request already identified passes."""
        if request.get(TENANT_KEY) is not None:
            return None
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        tenant = self.table.find(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            self.metrics.requests.labels(UNKNOWN_TENANT, "unauthorized").inc()
            said = "an unknown API key" if auth else "no API key"
            return _error(
                401,
                f"the request has {said}: send `Authorization: Bearer KEY` with a key the gateway's tenants list",
                "invalid_request_error",
                "invalid_api_key",
                **{"WWW-Authenticate": "Bearer"},  # RFC 6750: a 401 names the scheme it wants
            )
        request[TENANT_KEY] = tenant
        request[tracing.TENANT_KEY] = tenant.name  # the request's span carries it (router/tracing.py)
        return None

    @staticmethod
    def visible(request: ClientRequest, table: dict[str, T]) -> dict[str, T]:
        """The part of a model table the request's tenant may call (`/v1/models` lists only that)."""
        tenant = request[TENANT_KEY]
        return {name: entry for name, entry in table.items() if tenant.allows(name)}

    def forbidden(self, request: ClientRequest, model: str) -> web.Response | None:
        """403 `model_not_allowed` when the request's tenant may not call `model` (the gateway asks before it
        picks a service, so that nothing about the services behind the name answers first); None when it may."""
        tenant = request[TENANT_KEY]
        if tenant.allows(model):
            return None
        self.metrics.requests.labels(tenant.name, "forbidden").inc()
        return _error(
            403,
            f"tenant {tenant.name} may not call `{model}`; it may call {', '.join(sorted(tenant.models))}",
            "invalid_request_error",
            "model_not_allowed",
            "model",
        )

    async def forward(
        self,
        request: ClientRequest,
        body: dict[str, Any],
        model: str,
        router: Router,
        takes_priority: bool = True,
    ) -> Answer:
        """One request through the gate to `router`; `body` already names the model the engine serves.
        `takes_priority` False (an fcfs service): the body goes without `priority` (the tenant's or its
        own)."""
        tenant = request[TENANT_KEY]
        refused = self.forbidden(request, model)
        if refused is not None:
            return refused
        wrong = type_error(body)
        if wrong is not None:
            self.metrics.requests.labels(tenant.name, "invalid").inc()
            return _error(400, wrong[1], "invalid_request_error", "invalid_type", wrong[0])
        encode = router.hasher.encode
        # the prompt alone is also what a stream cut before its usage is charged at least (with its text)
        floor, prompts = prompt_tokens(body, encode)
        tokens = floor + completion_tokens(body, prompts)
        verdict, ticket = await self.limiter.admit(tenant, tokens)
        if not verdict.allowed:
            return self._refused(tenant, verdict, tokens, floor, body)
        self.metrics.requests.labels(tenant.name, "ok").inc()
        add_response_headers(request, verdict.headers())
        tap = self._rewrite(body, tenant, request.match_info.get("path", ""), takes_priority)
        tap.keep_text = tap.stream and tokens == floor  # no max_tokens: the estimate holds no answer
        request[RESPONSE_TAP] = tap
        # the tenant's key is the gateway's alone: the engines never see it
        request[DROP_AUTHORIZATION] = True
        try:
            response = await router.forward(request, json.dumps(body).encode())
        except BaseException:  # the client left (cancelled): settle without holding up the cancellation
            settling = self._settle(tenant, ticket, tokens, tap, None, floor, encode)
            task = asyncio.get_running_loop().create_task(settling)
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
            raise
        await self._settle(tenant, ticket, tokens, tap, response.status, floor, encode)
        return response

    def _refused(
        self, tenant: Tenant, verdict: Verdict, tokens: int, prompt: int, body: dict[str, Any]
    ) -> web.Response:
        """The 429 of a request the tenant's limits refuse: over the limit now (retry after), or larger
        than the whole limit (never: the field to shrink is named, the prompt's when it alone is too large)."""
        result = "too_large" if verdict.too_large else "rate_limited"
        self.metrics.requests.labels(tenant.name, result).inc()
        self.metrics.tokens.labels(tenant.name, result).inc(tokens)
        logger.info("event=tenant_refused tenant=%s result=%s tokens=%d", tenant.name, result, tokens)
        if verdict.too_large:
            limit = f"tenant {tenant.name}'s limit of {tenant.tpm} tokens per minute"
            if prompt > tenant.tpm:  # no max_tokens can make it fit
                param = next((f for f in ("messages", "prompt", "input") if f in body), "prompt")
                message = f"the prompt alone is {prompt} tokens, more than {limit}; send a shorter `{param}`"
            else:
                param = (
                    "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
                )
                message = (
                    f"the request may use {tokens} tokens (its prompt and {param}), more than {limit}; "
                    f"send a shorter prompt or a smaller {param}"
                )
            # `x-should-retry: false`: the openai client would otherwise retry a request that can never fit
            headers = {**verdict.headers(), "x-should-retry": "false"}
            return _error(429, message, "tokens", "tokens_exceed_limit", param, **headers)
        return _error(
            429,
            f"tenant {tenant.name} is over its limit of {tenant.rpm or 'unlimited'} requests and "
            f"{tenant.tpm or 'unlimited'} tokens per minute; retry after {verdict.headers()['Retry-After']} s",
            "requests",
            "rate_limit_exceeded",
            **verdict.headers(),
        )

    @staticmethod
    def _rewrite(body: dict[str, Any], tenant: Tenant, path: str, takes_priority: bool = True) -> UsageTap:
        """The tenant's priority into the body, usage asked of a stream; the tap that reads the usage back."""
        if path in PRIORITY_PATHS:
            if takes_priority:
                body["priority"] = tenant.priority
            else:  # an fcfs engine refuses any nonzero priority with a 400
                body.pop("priority", None)
        stream = body.get("stream") is True and path in STREAM_PATHS
        options = body.get("stream_options")
        asked = isinstance(options, dict) and options.get("include_usage") is True
        if stream and not asked:
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return UsageTap(stream, strip=stream and not asked)

    async def _settle(
        self,
        tenant: Tenant,
        ticket: object,
        charged: int,
        tap: UsageTap,
        status: int | None,
        prompt: int = 0,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        """The tenant charged what the request used: the engine's usage; without it, nothing for an error
        answer, else the estimate or, when more, the prompt plus the text streamed (a stream without
        `max_tokens` that the client cut before its usage came)."""
        used = tap.total_tokens()
        if used is None and status is not None and status >= 400:
            used = 0  # an error answer used nothing
        elif used is None:
            used = max(charged, prompt + text_tokens(tap.streamed_text(), encode))
        await self.limiter.settle(tenant, ticket, used - charged)
        self.metrics.tokens.labels(tenant.name, "ok").inc(used)
