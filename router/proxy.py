"""The router's HTTP side (aiohttp): forward each `/v1/...` request to the engine its policy picks.

- A request that fails before its first byte (connection refused or reset, or the engine answered 502,
  503 or 504) is retried on another engine, at most `max_retries` times; once a byte went to the client
  nothing is retried (the client may already have acted on it).
- No ready engine: the request waits up to `queue_timeout_s` in a bounded queue (scale from zero), then
  gets 503 with `Retry-After`.
- Bodies and Server-Sent Events are forwarded chunk by chunk as they arrive (no buffering). An answer
  whose events nothing reads (`_passes_through`: no stream relay, no usage tap) goes out with the engine's
  own chunked framing, one write per read and no Python call per chunk (router/upstream.py's raw
  connections); its framing is read (router/chunked.py) only if it breaks.
- With prefill engines in the set, a generation request first runs its prompt on a prefill engine and
  continues on a decode engine with the prompt's KV (router/disaggregation.py).
- A client that disconnects cancels the handler (aiohttp's handler cancellation, or the raw front's
  own); the upstream connection is closed with it, which the engine sees as a disconnect and aborts.
- `serve` puts the raw front (router/front.py) on the port: it parses `/v1/...` requests itself and hands
  them to `Router.forward` as `FrontRequest`s; /health, /ready, /metrics go to the aiohttp application
  behind it. The gateway (router/gateway.py) calls `forward` with aiohttp's `web.Request`s; both work.
- One INFO line per request that did not end "ok"; the ok ones at DEBUG, and one in
  `ACCESS_LOG_SAMPLE` at INFO (formatting and writing the line was a tenth of the router's CPU).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import disaggregation, resume
from .adapters import AdapterTable
from .chat_template import ChatTemplate, Unrenderable
from .chunked import ChunkedTail
from .endpoints import EndpointSet
from .front import Forwarder, Front, FrontRequest, FrontResponse, start_front
from .kv_subscriber import KVEventFeeds
from .metrics import RouterMetrics
from .policies import Choice, RouteRequest, RoutingPolicy
from .prefix import BlockHasher
from .upstream import EngineBroken, EnginePool, EngineResponse, EngineUnreachable
from .usage_tap import UsageTap

if TYPE_CHECKING:
    from .tracing import RouterTracer

logger = logging.getLogger("specfleet.router")

HOP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
    "proxy-authorization",
    "proxy-authenticate",
}
RETRYABLE_STATUS = (502, 503, 504)  # the engine is going away, overloaded, or not there: try another
# The largest request body forwarded: a 128k-token prompt as JSON is ~1 MB, with images or token-id lists
# a few times that; aiohttp's default (1 MiB) would refuse long prompts.
MAX_BODY_BYTES = 64 * 1024 * 1024
# Set on a request by the gateway's tenant gate (router/tenant_gate.py): every chunk of the engine's answer
# passes through it on the way out, so that the tenant is charged the usage the engine reported.
RESPONSE_TAP = web.RequestKey("specfleet_response_tap", UsageTap)
# Set by the tenant gate too: the client's `Authorization` holds its tenant key, the gateway's business
# alone; it is not passed on, so no engine (its logs, a debug dump) ever holds a tenant's key.
DROP_AUTHORIZATION = web.RequestKey("specfleet_drop_authorization", bool)
# Set on a streamed request the router can resume on another engine if its own fails (router/resume.py)
STREAM_RELAY = web.RequestKey("specfleet_stream_relay", resume.StreamRelay)
NOT_RESUMABLE = web.RequestKey("specfleet_not_resumable", str)  # why a stream is not (router/resume.py)
ADAPTER_POLL = web.AppKey("specfleet_adapter_poll", asyncio.Future)
# One request that ended "ok" in this many is logged at INFO (the rest at DEBUG): the line is what an
# operator greps to see the router is routing, not an access log; every failure is still logged.
ACCESS_LOG_SAMPLE = 100
# A client's request as the proxy reads it: aiohttp's (the gateway's application) or the raw front's
ClientRequest = web.Request | FrontRequest
Answer = web.StreamResponse | FrontResponse


def prompt_text(body: Any) -> tuple[str, list[int] | None]:
    """The text the engine will prefill (or token ids, for a prompt given as ids), from an OpenAI body.

    Chat messages are flattened as `role\\ncontent\\n` per message: not the model's chat template, but a
    prefix-preserving rendering, so conversations that share leading messages share leading blocks."""
    if not isinstance(body, dict):
        return "", None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return "", prompt
        if isinstance(prompt[0], str):
            return prompt[0], None  # a batch of prompts: route by the first
        if isinstance(prompt[0], list) and all(isinstance(t, int) for t in prompt[0]):
            return "", prompt[0]
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                # content parts: the text ones (a `text` that is no string is the engine's 400 to give)
                content = "".join(
                    t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str)
                )
            parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts), None
    return "", None


def _error(
    status: int, message: str, retry_after: int | None = None, code: str = "service_unavailable"
) -> web.Response:
    body = {"error": {"message": message, "type": code, "param": None, "code": None}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)


@dataclass
class Router:
    endpoints: EndpointSet
    policy: RoutingPolicy
    hasher: BlockHasher = field(default_factory=BlockHasher)
    session_header: str | None = "x-session-id"  # None: no session affinity
    max_retries: int = 2  # other engines tried after a failure before the first byte
    queue_timeout_s: float = 0.0  # how long a request waits for a ready engine (0: answer 503 at once)
    max_queue: int = 256  # requests waiting at most; more get 503 at once
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 3600.0
    stopping: bool = False  # SIGTERM came: /ready fails so the Service drops this pod (router/shutdown.py)
    draining: bool = False  # after the shutdown delay: new requests get 503, in-flight ones finish
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    on_queue: Callable[[int], None] | None = (
        None  # called with the queue's length when a request starts waiting
    )
    tracer: RouterTracer | None = None  # request spans (router/tracing.py); None: traces off
    kv_feeds: KVEventFeeds | None = None  # the engines' KV events (router/kv_subscriber.py); None: off
    max_resumes: int = 2  # times a stream cut mid-way goes on from another engine (router/resume.py)
    adapters: AdapterTable | None = None  # LoRA adapter affinity (router/adapters.py); None: off
    # The model's chat template (router/chat_template.py): chat requests hashed as the engine renders them;
    # None: chat requests are hashed on prompt_text's flattening and matched on the estimate
    chat_template: ChatTemplate | None = None

    def __post_init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self.engines = EnginePool()  # the forwarded requests' connections (router/upstream.py)
        self._changed = asyncio.Event()
        self._waiting = 0
        self.cold_start_s: float | None = None  # the last scale from zero: the first queued request's wait
        self.synced = False  # discovery reported at least once: before that, an empty set means "unknown"
        self._in_flight = 0
        self._ok_count = 0  # requests that ended "ok": every ACCESS_LOG_SAMPLE-th is logged at INFO

    @property
    def in_flight(self) -> int:
        """Client requests this router is handling now (streams included, until their last byte)."""
        return self._in_flight

    # ---- endpoint changes (discovery and the local fleet call this) -------------------------------
    @property
    def queued(self) -> int:
        """Requests waiting for a ready engine now."""
        return self._waiting

    def endpoints_changed(self, removed: list[str] | None = None) -> None:
        for url in removed or []:
            self.policy.forget(url)
        self.synced = True
        if self.kv_feeds is not None:
            self.kv_feeds.sync(e.url for e in self.endpoints.all())
        self.metrics.observe_endpoints(self.endpoints)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_endpoint(self) -> bool:
        """Scale from zero: hold the request until an engine is ready or the timeout passes."""
        if self.queue_timeout_s <= 0 or self._waiting >= self.max_queue or self.stopping:
            return False
        first = self._waiting == 0  # the first request held: its wait is the cold start the client saw
        self._waiting += 1
        self.metrics.queued.set(self._waiting)
        if self.on_queue is not None:
            self.on_queue(self._waiting)  # e.g. scale from zero
        start = time.monotonic()
        try:
            while not self.endpoints.routable():
                left = self.queue_timeout_s - (time.monotonic() - start)
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
                except TimeoutError:
                    pass
            if first:
                self.cold_start_s = time.monotonic() - start
                self.metrics.cold_start.set(self.cold_start_s)
            return True
        finally:
            self._waiting -= 1
            self.metrics.queued.set(self._waiting)
            self.metrics.queue_wait.observe(time.monotonic() - start)

    # ---- HTTP ---------------------------------------------------------------------------------------
    def client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            )
        return self._session

    async def close(self) -> None:
        self.engines.close()
        if self.kv_feeds is not None:
            self.kv_feeds.subscriber.close()
        if self._session is not None:
            await self._session.close()

    def route_request(self, body: bytes, headers: Any) -> RouteRequest:
        return self._route_parsed(_parse(body), headers)

    def _route_parsed(self, parsed: Any, headers: Any) -> RouteRequest:
        if self.tracer is not None:
            self.tracer.note_body(parsed)
        text, ids = prompt_text(parsed)
        salt = parsed.get("cache_salt") if isinstance(parsed, dict) else None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        adapter = model if self.adapters is not None and self.adapters.known(model) else None
        # A prompt given as text or ids is hashed as the engine hashes it (by the model's tokenizer); so are
        # chat messages the model's chat template renders here as in the engine (render_chat); others are
        # flattened by prompt_text and matched on the estimate (RouteRequest.engine_hashes)
        chat = not (
            isinstance(parsed, dict) and isinstance(parsed.get("prompt"), str | list) and parsed["prompt"]
        )
        engine_hashes = self.hasher.encode is not None and not chat
        if chat and self.hasher.encode is not None and isinstance(parsed, dict) and "messages" in parsed:
            rendered = self.render_chat(parsed)
            if rendered is not None:
                text, ids, engine_hashes = rendered, None, True
        if ids is not None and self.hasher.encode is not None:
            from .prefix import chain_hashes, token_blocks

            seed = self.hasher.salted_seed(salt, adapter)
            hashes = chain_hashes(token_blocks(ids, self.hasher.block_size), seed)
        else:
            hashes = self.hasher.hashes(text, salt, adapter) if text else []
        session = headers.get(self.session_header) if self.session_header else None
        return RouteRequest(tuple(hashes), session, adapter, engine_hashes)

    def render_chat(self, body: dict[str, Any]) -> str | None:
        """A chat request's prompt text as the engine renders it, or None (with the reason counted in
        specfleet_router_chat_prompts and logged at DEBUG) where the router cannot reproduce it."""
        if self.chat_template is None:
            self.metrics.chat_prompts.labels("no_template").inc()
            return None
        try:
            text = self.chat_template.render(body)
        except Unrenderable as exc:
            self.metrics.chat_prompts.labels(exc.reason).inc()
            logger.debug("event=chat_on_estimate reason=%s detail=%s", exc.reason, exc.detail[:200])
            return None
        self.metrics.chat_prompts.labels("rendered").inc()
        return text

    def choose(self, request: RouteRequest, tried: set[str]) -> Choice | None:
        candidates = [e for e in self.endpoints.routable() if e.url not in tried]
        if request.adapter is not None and self.adapters is not None:
            candidates = self.adapters.candidates(request.adapter, candidates)
        choice = self.policy.choose(request, candidates)
        if choice is not None:
            self.policy.routed(request, choice.url)  # before the send: the next decision sees this one
            self.metrics.decisions.labels(self.policy.name, choice.reason).inc()
            self.metrics.prefix_blocks.labels("prompt").inc(len(request.hashes))
            self.metrics.prefix_blocks.labels("matched").inc(choice.match_blocks)
        return choice

    @overload
    async def forward(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse: ...
    @overload
    async def forward(self, request: FrontRequest, body: bytes | None = None) -> Answer: ...
    async def forward(self, request: ClientRequest, body: bytes | None = None) -> Answer:
        """Forward one client request; `body` replaces the request's own (the gateway rewrites `model`)."""
        if self.draining:
            self.metrics.requests.labels("", "unavailable").inc()
            return _error(503, "the router is stopping; retry against another endpoint", 5)
        self._in_flight += 1
        try:
            content = await request.read() if body is None else body
            if self.tracer is not None:
                return await self.tracer.serve(request, lambda: self._route(request, content))
            return await self._route(request, content)
        finally:
            self._in_flight -= 1

    async def _route(self, request: ClientRequest, body: bytes) -> Answer:
        parsed = _parse(body) if request.method == "POST" else None
        route = self._route_parsed(parsed, request.headers) if request.method == "POST" else RouteRequest()
        dropped = HOP_HEADERS | {"authorization"} if request.get(DROP_AUTHORIZATION) else HOP_HEADERS
        headers = {k: v for k, v in request.headers.items() if k.lower() not in dropped}
        held: dict[str, Any] | None = None  # a prefill engine's hold on this prompt's KV blocks
        pd_body = (
            disaggregation.parse(request.match_info.get("path", ""), request.method, body)
            if self.endpoints.prefill_routable()
            else None
        )
        if pd_body is not None:
            # Shielded from the handler's cancellation: a client that leaves while the prefill engine works
            # would otherwise lose the answer that names the hold the engine has just made, and the blocks
            # would wait out the hold's timeout; the prefill finishes and its hold is released instead.
            def run_prefill(hop_headers: dict[str, str]) -> Any:
                path = request.match_info["path"]
                return disaggregation.prefill(self.client(), self.endpoints, path, pd_body, hop_headers)

            prefilling = asyncio.ensure_future(
                run_prefill(headers)
                if self.tracer is None
                else self.tracer.hop("prefill_request", headers, run_prefill, {})
            )
            try:
                held = await asyncio.shield(prefilling)
            except asyncio.CancelledError:
                prefilling.add_done_callback(_release_when_prefilled)
                raise
            except disaggregation.Refusal as refusal:
                self.metrics.requests.labels("", "client_error").inc()
                return web.Response(
                    body=refusal.content,
                    status=refusal.status,
                    headers={"Content-Type": refusal.content_type or "application/json"},
                )
            if held is not None:
                body, parsed = disaggregation.decode_body(pd_body, held), None
                headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
                headers["Content-Type"] = "application/json"
        delivered = False
        try:
            response = await self._forward(request, body, headers, route, parsed)
            # a decode engine took the request: the hold is its to consume (a refusal leaves it unconsumed)
            delivered = response.status < 300
            return response
        finally:
            if held is not None and not delivered:
                # no decode engine took the KV (the client left, or none could be reached): free it now
                asyncio.get_running_loop().run_in_executor(None, disaggregation.release, held)

    async def _forward(
        self, request: ClientRequest, body: bytes, headers: dict[str, str], route: RouteRequest, parsed: Any
    ) -> Answer:
        """Send the request to the engines the policy picks, retrying before the first byte; `parsed`: the
        body as route_request read it (None: not parsed)."""
        tried: set[str] = set()
        last_error = ""
        started = time.monotonic()
        parsed, why_not = resume.plan(
            request.match_info.get("path", ""), request.method, body, self.max_resumes, parsed
        )
        if parsed is not None:
            headers = {**headers, resume.TOKEN_IDS_HEADER: "1"}
            request[STREAM_RELAY] = resume.StreamRelay(parsed, (route, tried, headers))
        elif why_not is not None:
            request[NOT_RESUMABLE] = why_not
        for attempt in range(self.max_retries + 1):
            choosing = time.monotonic()
            choice = self.choose(route, tried)
            if choice is None and attempt == 0 and await self._wait_for_endpoint():
                choice = self.choose(route, tried)
            if self.tracer is not None:
                self.tracer.routed(choosing, choice, self.policy.name, attempt)
            if choice is None:
                break
            url = choice.url
            tried.add(url)
            self.endpoints.acquire(url)
            try:
                if self.tracer is None:
                    outcome = await self._send(request, url, body, headers, choice, attempt, started)
                else:
                    outcome = await self.tracer.hop(
                        "engine_request",
                        headers,
                        functools.partial(
                            self._send, request, url, body, choice=choice, attempt=attempt, started=started
                        ),
                        {"specfleet.engine": url, "specfleet.route.attempt": attempt},
                    )
            except _RetryableFailure as failure:
                last_error = str(failure)
                self.metrics.retries.labels(url).inc()
                logger.info("event=retry engine=%s attempt=%d error=%r", url, attempt, last_error)
                continue
            finally:
                self.endpoints.release(url)
            return outcome
        if last_error:
            self.metrics.requests.labels(sorted(tried)[-1] if tried else "", "engine_error").inc()
            return _error(
                502,
                f"no engine could take the request ({len(tried)} tried); last error: {last_error}",
                1,
                "bad_gateway",
            )
        self.metrics.requests.labels("", "unavailable").inc()
        return _error(503, "no engine is ready; retry shortly", 1 if self.queue_timeout_s <= 0 else 5)

    async def _send(
        self,
        request: ClientRequest,
        url: str,
        body: bytes,
        headers: dict[str, str],
        choice: Choice,
        attempt: int,
        started: float,
    ) -> Answer:
        tap = request.get(RESPONSE_TAP)
        relay = request.get(STREAM_RELAY)
        try:
            upstream = await self.engines.request(
                url,
                request.method,
                str(request.rel_url),
                headers,
                body,
                self.connect_timeout_s,
                self.request_timeout_s,
                raw=_passes_through(request, tap, relay),
            )
        except EngineUnreachable as error:
            raise _RetryableFailure(str(error)) from error
        try:
            if upstream.status in RETRYABLE_STATUS and attempt < self.max_retries:
                text = (await upstream.read(300)).decode(errors="replace")
                raise _RetryableFailure(f"engine answered {upstream.status}: {text}")
            answer = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS]
            out: Answer
            if isinstance(request, FrontRequest):  # its head leaves with the first body piece
                out = FrontResponse(request, upstream.status, answer, upstream.framed)
            else:
                out = web.StreamResponse(status=upstream.status, headers=CIMultiDict(answer))
            outcome = (
                "ok" if upstream.status < 400 else "client_error" if upstream.status < 500 else "engine_error"
            )
            tail: ChunkedTail | None = None
            try:
                if isinstance(out, web.StreamResponse):
                    assert isinstance(request, web.Request)
                    await out.prepare(request)
                if relay is not None and upstream.status == 200:
                    outcome = await resume.follow(self, str(request.rel_url), out, upstream, relay, tap)
                    await out.write_eof(b"" if tap is None else tap.flush())
                    return out
                # A passed-through body's framing is read only if it breaks (where it stopped)
                tail = ChunkedTail() if upstream.framed else None
                if tail is not None and tap is None and isinstance(out, FrontResponse):
                    await upstream.pipe(functools.partial(_pass_on, tail, out), out.drained)
                    await out.write_eof()
                    return out
                last = b""  # the body's last bytes go out with the stream's end, in one write
                async for chunk in upstream.chunks():
                    if tap is not None:
                        chunk = tap.feed(chunk)
                    elif tail is not None:
                        tail.add(chunk)
                    if upstream.ended:
                        last = chunk
                    else:
                        await out.write(chunk)
                await out.write_eof(last if tap is None else last + tap.flush())
            except asyncio.CancelledError:  # aiohttp cancels the handler when its client leaves
                outcome = "disconnected"
                raise
            except ConnectionResetError:  # or a write finds the client's transport already closing
                outcome = "disconnected"  # nothing to tell it; raising would only log a handler error
            except (EngineBroken, TimeoutError) as error:  # the engine failed mid-stream: no retry
                outcome = "broken"
                logger.warning("event=broken engine=%s error=%r", url, f"{type(error).__name__}: {error}")
                if tail is None or _unframe(out, tail):
                    await _tell_broken(out, upstream, request.get(NOT_RESUMABLE))
            finally:
                self._answered(url, upstream, outcome, choice, attempt, started)
            return out
        finally:
            upstream.close()  # on a client disconnect this drops the engine's connection: it aborts

    def _answered(
        self, url: str, upstream: EngineResponse, outcome: str, choice: Choice, attempt: int, started: float
    ) -> None:
        """A forwarded request's bookkeeping once its answer ended: trace, metrics and the access log line
        (every outcome but `ok` at INFO; one `ok` in ACCESS_LOG_SAMPLE at INFO, the rest at DEBUG)."""
        if self.tracer is not None:
            self.tracer.answered(upstream.status, outcome, upstream.headers)
        self.metrics.requests.labels(url, outcome).inc()
        self.metrics.prefix_match.observe(choice.match_blocks * self.hasher.block_size)
        level = logging.INFO
        if outcome == "ok":
            self._ok_count += 1
            level = logging.INFO if self._ok_count % ACCESS_LOG_SAMPLE == 1 else logging.DEBUG
        logger.log(
            level,
            "event=request engine=%s policy=%s reason=%s match_blocks=%d status=%d outcome=%s attempt=%d ms=%.0f",
            url,
            self.policy.name,
            choice.reason,
            choice.match_blocks,
            upstream.status,
            outcome,
            attempt,
            1000 * (time.monotonic() - started),
        )


def _parse(body: bytes) -> Any:
    """A request body's JSON (None when empty or not JSON), read once for routing and the stream relay."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def _passes_through(request: ClientRequest, tap: UsageTap | None, relay: resume.StreamRelay | None) -> bool:
    """Whether the engine's answer goes to the client as the engine framed it (upstream.py's raw
    connections): nothing on the way reads its events. The ones that do: the stream relay (a resumable
    stream's token ids and cuts, router/resume.py) and the gateway's usage tap (a tenant's usage,
    router/usage_tap.py). The tracer reads the answer's status and headers only; a disaggregated request's
    decode answer is relayed like any other (the prefill's answer comes over aiohttp's client). The front
    answers over HTTP/1.1 in chunks (an HTTP/1.0 client gets the body unframed); aiohttp's server (the
    gateway) frames what it is given."""
    return (
        tap is None
        and relay is None
        and isinstance(request, FrontRequest)
        and request.version == "1.1"
        and request.method != "HEAD"
    )


def _pass_on(tail: ChunkedTail, out: FrontResponse, data: bytes) -> bool:
    """One read of a passed-through body to the client, from the engine connection's callback."""
    tail.add(data)
    return out.write_now(data)


def _unframe(out: Answer, tail: ChunkedTail) -> bool:
    """A passed-through body broke: whether the router may still write to it (it stopped between two
    chunks, so what follows is framed here); else the client's connection is closed at once."""
    if isinstance(out, FrontResponse) and out.framed and not tail.at_boundary():
        out.cut()
        return False
    if isinstance(out, FrontResponse):
        out.unframe()
    return True


def _release_when_prefilled(prefilling: asyncio.Future[dict[str, Any] | None]) -> None:
    """The client left during the prefill: release the hold the prefill engine made, if it made one."""
    if prefilling.cancelled() or prefilling.exception() is not None:
        return
    held = prefilling.result()
    if held is not None:
        logger.info(
            "event=kv_release reason=client_gone_during_prefill transfer_id=%s", held.get("transfer_id")
        )
        asyncio.get_running_loop().run_in_executor(None, disaggregation.release, held)


async def _tell_broken(out: Answer, upstream: EngineResponse, why_not: str | None) -> None:
    """A stream the router could not resume ends with an error event saying why, not in silence."""
    if why_not is None or not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
        return
    try:
        await out.write(
            resume.error_event(f"the engine failed mid-stream and the stream cannot be resumed: {why_not}")
        )
    except ConnectionResetError:
        pass


class _RetryableFailure(Exception):
    """The engine failed before the first byte reached the client: safe to send elsewhere."""


def create_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(_: web.Request) -> web.Response:
        """Ready once discovery has reported: with no engine ready the router still answers (503 with
        Retry-After, or queues for scale from zero), which is better than a connection refused."""
        if router.stopping:
            return _error(503, "the router is stopping", 5)
        if not router.synced:
            return _error(503, "endpoint discovery has not reported yet", 1)
        return web.json_response({"status": "ready", "engines": len(router.endpoints.routable())})

    async def metrics(_: web.Request) -> web.Response:
        router.metrics.observe_endpoints(router.endpoints)
        return web.Response(
            body=generate_latest(router.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def on_startup(app: web.Application) -> None:
        if router.adapters is not None:
            app[ADAPTER_POLL] = asyncio.ensure_future(router.adapters.run(router.endpoints))

    async def on_cleanup(app: web.Application) -> None:
        if ADAPTER_POLL in app:
            app[ADAPTER_POLL].cancel()
        await router.close()

    async def close_when_stopping(_: web.Request, response: web.StreamResponse) -> None:
        """Once stopping, every response ends its connection: a keep-alive client's next request opens a new
        one, which the Service sends to a router that is not stopping."""
        if router.stopping:
            response.force_close()  # the server closes the connection after this response
            response.headers["Connection"] = "close"  # and says so (the headers are built before this hook)

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/v1/{path:.*}", router.forward)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.on_response_prepare.append(close_when_stopping)
    return app


# The runner's cleanup (after the drain: router/shutdown.py) gives requests still running this long to end
# before it cancels them; the drain has already waited for them, so this only lets last bytes leave.
CLEANUP_GRACE_SECONDS = 0.5


async def serve(router: Router, host: str, port: int) -> Front:
    """Start the router's server on the running loop: the raw front (router/front.py) on host:port, its
    application behind it on a loopback port; the caller keeps the front and cleans it up."""
    return await serve_behind_front(router, create_app(router), host, port)


async def serve_behind_front(forwarder: Forwarder, app: web.Application, host: str, port: int) -> Front:
    """The raw front on host:port handing `/v1/...` to `forwarder` (a Router, the gateway), `app` on a
    loopback port behind it for the rest; handlers whose client left are cancelled, and requests get
    CLEANUP_GRACE_SECONDS at cleanup. Port 0 takes one the kernel picks (`Front.port`)."""
    return await start_front(forwarder, app, host, port, _start_app_on, MAX_BODY_BYTES, CLEANUP_GRACE_SECONDS)


async def _start_app_on(app: web.Application, sock: socket.socket) -> web.AppRunner:
    runner = await _runner(app)
    await web.SockSite(runner, sock).start()
    return runner


async def _runner(app: web.Application) -> web.AppRunner:
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=CLEANUP_GRACE_SECONDS,
    )
    await runner.setup()
    return runner
