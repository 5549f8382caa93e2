"""The router's raw HTTP/1.1 front: client requests to `/v1/...` parsed and answered without aiohttp's server.

aiohttp's server side (a `web.Request` per request, `StreamResponse` and its writer) was a third of the
router's CPU per streamed request and the largest part of what it added to one request over nginx
(`specfleet bench router`, docs/results/2026-12-03-bench-router.md). Here an asyncio Protocol (on uvloop
where the router runs) parses the client's requests with httptools (llhttp, in C), hands each `/v1/...` one
to `Router.forward` as a `FrontRequest`, and writes the answer itself: the response head goes out with the
first body piece in one `writelines` (no copy into one buffer), each later piece as one chunk, or as it
came where the body already carries the engine's chunked framing (`FrontResponse(framed=True)`).

What the front does itself, as aiohttp's server did:
- HTTP/1.1 keep-alive (an idle connection closes after `KEEPALIVE_TIMEOUT_S`), pipelined requests answered
  in order (reading pauses past `MAX_PIPELINED` waiting ones), chunked request bodies (llhttp decodes them),
  `Expect: 100-continue` (answered at once when no response is being written on the connection; a client
  that sends the body anyway is read alike), HTTP/1.0 (no chunked framing, the connection closes).
- Bad input gets a JSON error naming the limit and the connection closes: a request that does not parse
  400, a head over `MAX_HEAD_BYTES` 431, a body over the router's `MAX_BODY_BYTES` 413.
- A client that disconnects cancels its request's task, as aiohttp's handler cancellation did: the proxy
  drops the engine's connection and the engine aborts the request.
- Backpressure: a write waits while the client's transport holds more than its high-water mark, so the
  proxy stops reading from the engine and TCP slows the engine down (router/upstream.py).
- Once the router is stopping, every response says `Connection: close` and ends its connection.

Every other path (/health, /ready, /metrics, and whatever else the aiohttp application serves) goes, as it
came, over a keep-alive loopback connection to the router's aiohttp application, which listens on an
ephemeral port of 127.0.0.1 behind the front; its answer comes back through the same writer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar, cast
from urllib.parse import unquote

import httptools
from aiohttp import web
from multidict import CIMultiDict

from .upstream import EnginePool, EngineResponse, EngineUnreachable

logger = logging.getLogger("specfleet.router")
T = TypeVar("T")
# Headers a hop before the router adds to whatever answers the request (the gateway's service that answered,
# the tenant's rate limits): the front writes them into the head of every answer, the aiohttp applications
# add them as the response is prepared (`add_response_headers`).
RESPONSE_HEADERS = web.RequestKey("specfleet_response_headers", dict)

# The request line and headers together: nginx's default large_client_header_buffers are 4 x 8 KiB and
# aiohttp's were 8190 bytes a line; 16 KiB holds any OpenAI client's head with room for long API keys and
# traceparent/baggage headers.
MAX_HEAD_BYTES = 16 * 1024
# Requests read ahead of the one being answered on one connection: beyond this the front stops reading
# (TCP then holds the client), so a pipelining client cannot make the router buffer without bound.
MAX_PIPELINED = 8
# An idle keep-alive connection is closed after this long: aiohttp's default, which the router had before.
KEEPALIVE_TIMEOUT_S = 75.0
_NO_BODY_STATUS = frozenset({204, 304})
# Headers of the client's request that are this hop's own (the proxy drops the same set: proxy.HOP_HEADERS)
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}
)
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    413: "Payload Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class Forwarder(Protocol):
    """What the front needs of the router (proxy.Router is one)."""

    stopping: bool

    def forward(self, request: FrontRequest) -> Awaitable[Any]: ...


class FrontRequest:
    """One client request as the proxy reads it: what it reads of aiohttp's `web.Request`."""

    __slots__ = (
        "_values",
        "body",
        "connection",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "rel_url",
        "version",
    )

    def __init__(
        self,
        connection: _Connection,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes,
        version: str,
        keep_alive: bool,
    ) -> None:
        self.connection = connection  # the client's: where the answer goes
        self.method = method
        self.rel_url = target  # as the client sent it: the proxy forwards it unchanged
        path = target.partition("?")[0]
        self.path = unquote(path) if "%" in path else path
        self.match_info = {"path": self.path[4:]} if self.path.startswith("/v1/") else {}
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        self._values: dict[object, Any] = {}

    def get(self, key: web.RequestKey[T]) -> T | None:
        return cast("T | None", self._values.get(key))

    def __getitem__(self, key: web.RequestKey[T]) -> T:
        return cast("T", self._values[key])

    def __setitem__(self, key: web.RequestKey[T], value: T) -> None:
        self._values[key] = value

    async def read(self) -> bytes:
        return self.body


class FrontResponse:
    """The answer to one `FrontRequest`: the head waits for the first body piece and leaves with it."""

    def __init__(
        self, request: FrontRequest, status: int, headers: Iterable[tuple[str, str]], framed: bool = False
    ) -> None:
        self.status = status
        conn = self._conn = request.connection
        self.ended = False
        self._bodiless = request.method == "HEAD" or status in _NO_BODY_STATUS or status < 200
        self._chunked = request.version == "1.1" and not self._bodiless
        # framed: the body is written with its chunked framing already on it (an engine's, passed through),
        # its last chunk included; `unframe` goes back to framing what is written (an error event after a cut)
        self.framed = framed
        if framed and not self._chunked:
            raise ValueError(
                "a framed body needs a chunked answer (an HTTP/1.1 request, a status with a body)"
            )
        close = not conn.keeps_alive(request)
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        for name, value in headers:
            lines.append(f"{name}: {value}\r\n")
        added = request._values.get(RESPONSE_HEADERS)
        if added:
            lines.extend(f"{name}: {value}\r\n" for name, value in added.items())
        if self._chunked:
            lines.append("Transfer-Encoding: chunked\r\n")
        if close:
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        self._head: bytes | None = "".join(lines).encode("utf-8", "surrogateescape")

    async def prepare(self) -> None:
        """Send the head now (a response whose body may take long to start)."""
        if self._head is not None:
            await self._send([])

    async def write(self, data: bytes) -> None:
        if data or self._head is not None:
            await self._send(self._framed(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if not self.ended:
            await self._send(self._ending(data))

    def write_now(self, data: bytes) -> bool:
        """Write `data` at once, from a protocol callback (upstream.py's pipe): whether the client's
        transport is now full (the caller stops reading until `drained`). A client already gone gets
        nothing: its task is being cancelled."""
        return self._write_now(self._framed(data))

    def end_now(self, data: bytes) -> None:
        """`write_eof(data)` at once, from a protocol callback (the stream relay's: router/resume.py): the
        body's last bytes and its end leave in one write."""
        if not self.ended:
            self._write_now(self._ending(data))

    def _ending(self, data: bytes) -> list[bytes]:
        """The body's last bytes and, where this side frames the chunks, the last chunk; the answer ends."""
        pieces = self._framed(data)
        if self._chunked and not self.framed:
            pieces.append(b"0\r\n\r\n")
        self.ended = True
        return pieces

    def _write_now(self, pieces: list[bytes]) -> bool:
        conn = self._conn
        if conn.transport is None:
            return False
        if self._head is not None:
            pieces.insert(0, self._head)
            self._head = None
            conn.head_sent = True
        if len(pieces) == 1:
            conn.transport.write(pieces[0])
        else:
            conn.transport.writelines(pieces)
        return conn.writable is not None and not conn.writable.done()

    async def drained(self) -> None:
        """Until the client's transport takes writes again."""
        writable = self._conn.writable
        if writable is not None and not writable.done():
            await writable

    def unframe(self) -> None:
        """From now on what is written is framed here (the passed-through body ended between two chunks)."""
        self.framed = False

    def cut(self) -> None:
        """End the answer without its end: the connection closes at once (a passed-through body broke in the
        middle of a chunk, which no chunk of ours can follow), and the client reads it as incomplete."""
        self.ended = True
        transport = self._conn.transport
        if transport is not None:
            transport.abort()

    def _framed(self, data: bytes) -> list[bytes]:
        if not data or self._bodiless:
            return []
        if not self._chunked or self.framed:
            return [data]
        return [b"%x\r\n" % len(data), data, b"\r\n"]

    async def _send(self, pieces: list[bytes]) -> None:
        if self._head is not None:
            pieces.insert(0, self._head)
            self._head = None
            self._conn.head_sent = True
        if pieces:
            await self._conn.send(pieces)


def add_response_headers(request: web.Request | FrontRequest, headers: dict[str, str]) -> None:
    """Headers for the answer to `request`, whoever writes it (RESPONSE_HEADERS)."""
    added = request.get(RESPONSE_HEADERS)
    if added is None:
        request[RESPONSE_HEADERS] = added = {}
    added.update(headers)


async def write_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """RESPONSE_HEADERS on an aiohttp application's answer (its `on_response_prepare` hook)."""
    for name, value in request.get(RESPONSE_HEADERS, {}).items():
        response.headers[name] = value


class _Refused(Exception):
    """The request cannot be read: answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": code, "param": None, "code": None}}).encode()


class _Connection(asyncio.Protocol):
    """One client connection: parse what arrives, answer requests in order on one task at a time."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.waiting: deque[FrontRequest | _Refused] = deque()
        # One task per connection answers its requests in order and waits for the next one between them
        # (a task per request cost more than the rest of the front's own work per request)
        self.task: asyncio.Task[None] | None = None
        self.busy = False  # a request is being answered
        self.next_request: asyncio.Future[None] | None = None  # set when a request arrives for the idle task
        self.last_active = 0.0  # the loop's time of the last byte read or answer written
        self.writable: asyncio.Future[None] | None = None  # set while the client's transport is full
        self.idle_timer: asyncio.TimerHandle | None = None
        self.refused = False
        self.head_sent = False  # the answer being written has begun: an error can no longer replace it
        self.read_paused = False
        self.in_head = False  # a request's head has begun and not ended
        self.unparsed_head = 0  # bytes read since, with a head incomplete (httptools buffers a header)
        self.head_fresh = False  # the head began in the read being parsed (not counted: it holds more)
        self._message()

    def _message(self) -> None:
        self.url = b""
        self.head_size = 0
        self.header_list: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.body_size = 0

    # -- transport ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.front.connections.add(self)
        self.last_active = asyncio.get_running_loop().time()
        self.idle_timer = asyncio.get_running_loop().call_later(KEEPALIVE_TIMEOUT_S, self._idle)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.last_active = self.front.loop.time()
        try:
            self.parser.feed_data(data)
            if self.in_head and not self.head_fresh:  # later reads while one head is still incomplete
                self.unparsed_head += len(data)
            self.head_fresh = False
            if self.unparsed_head > MAX_HEAD_BYTES:  # one header too long to be handed to on_header yet
                raise _Refused(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
        except _Refused as refusal:
            self._refuse(refusal)
        except httptools.HttpParserCallbackError as error:
            cause = error.__context__
            self._refuse(cause if isinstance(cause, _Refused) else _Refused(400, f"bad request: {cause}"))
        except httptools.HttpParserUpgrade:
            self._refuse(_Refused(400, "protocol upgrades (Upgrade, CONNECT) are not served"))
        except httptools.HttpParserError as error:
            self._refuse(_Refused(400, f"the request does not parse as HTTP/1.1: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.front.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.task is not None:
            self.task.cancel()  # the request's handler: the proxy drops its engine connection
        if self.writable is not None and not self.writable.done():
            self.writable.set_exception(ConnectionResetError("the client closed the connection"))
            self.writable.exception()  # retrieved here: no "exception never retrieved" when none waits

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    # -- parser ------------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_head = True
        self.head_fresh = True
        self.unparsed_head = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        self.header_list.append(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))  # as aiohttp decodes them
        )

    def _count(self, size: int) -> None:
        self.head_size += size
        if self.head_size > MAX_HEAD_BYTES:
            raise _Refused(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self.in_head = False
        length = next((v for k, v in self.header_list if k.lower() == "content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.front.max_body_bytes:
            raise _Refused(
                413, f"the request body ({length} bytes) exceeds {self.front.max_body_bytes} bytes"
            )
        expect = next((v for k, v in self.header_list if k.lower() == "expect"), None)
        if expect is not None and expect.lower() == "100-continue" and not self.busy and not self.waiting:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size > self.front.max_body_bytes:
            raise _Refused(413, f"the request body exceeds {self.front.max_body_bytes} bytes")
        self.body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        request = FrontRequest(
            self,
            parser.get_method().decode("ascii"),
            self.url.decode("utf-8", "surrogateescape"),
            CIMultiDict(self.header_list),
            body,
            parser.get_http_version(),
            parser.should_keep_alive(),
        )
        self._message()
        self.waiting.append(request)
        if len(self.waiting) >= MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()
            self.read_paused = True
        self._start()

    # -- answering ---------------------------------------------------------------------------------------
    def _refuse(self, refusal: _Refused) -> None:
        self.refused = True  # nothing after the bad bytes is read: the connection ends after the answer
        self.waiting.append(refusal)
        self._start()

    def _start(self) -> None:
        if self.task is None:
            self.task = self.front.loop.create_task(self._answer_all())
        elif self.next_request is not None and not self.next_request.done():
            self.next_request.set_result(None)

    def keeps_alive(self, request: FrontRequest) -> bool:
        return request.keep_alive and request.version == "1.1" and not self.front.router.stopping

    async def _answer_all(self) -> None:
        loop = self.front.loop
        while self.transport is not None:
            if not self.waiting:
                self.busy = False
                self.last_active = loop.time()
                self.next_request = loop.create_future()
                await self.next_request  # connection_lost cancels the wait
                continue
            self.busy = True
            item = self.waiting.popleft()
            if self.read_paused and len(self.waiting) < MAX_PIPELINED:
                self.read_paused = False
                self.transport.resume_reading()
            if isinstance(item, _Refused):
                await self._answer_refusal(item)
                self.transport.close()
                break
            try:
                await self._answer(item)
            except ConnectionResetError:
                break  # the client left while its answer was written: connection_lost cleans up
            if self.transport is None or not self.keeps_alive(item):
                if self.transport is not None:
                    self.transport.close()  # after what is buffered has been sent
                break
        self.busy = False

    async def _answer(self, request: FrontRequest) -> None:
        front = self.front
        self.head_sent = False
        try:
            if request.path.startswith("/v1/"):
                result = await front.router.forward(request)
            else:
                result = await front.to_back(request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # a bug: the client gets a 500 it can read, the log the traceback
            logger.exception("event=front_error method=%s path=%s", request.method, request.path)
            if self.head_sent:  # too late for a 500: the client sees the answer cut, as from a broken engine
                if self.transport is not None:
                    self.transport.abort()
                raise ConnectionResetError("the answer failed after its head") from None
            result = web.json_response(
                {
                    "error": {
                        "message": "internal error",
                        "type": "internal_error",
                        "param": None,
                        "code": None,
                    }
                },
                status=500,
            )
        if isinstance(result, FrontResponse):
            if not result.ended:  # e.g. an answer cut by a broken engine: the stream ends
                await result.write_eof()
            return
        if not isinstance(result, web.Response):
            raise TypeError(f"the router answered {type(result).__name__}, not a Response")
        body = result.body if isinstance(result.body, bytes) else b""
        headers = [(k, v) for k, v in result.headers.items() if k.lower() not in _HOP_HEADERS]
        await FrontResponse(request, result.status, headers).write_eof(body)

    async def _answer_refusal(self, refusal: _Refused) -> None:
        code = "invalid_request_error" if refusal.status == 400 else "request_too_large"
        request = FrontRequest(self, "GET", "/", CIMultiDict(), b"", "1.1", False)
        response = FrontResponse(request, refusal.status, [("Content-Type", "application/json")])
        try:
            await response.write_eof(error_body(refusal.message, code))
        except ConnectionResetError:
            pass

    async def send(self, pieces: list[bytes]) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if len(pieces) == 1:
            self.transport.write(pieces[0])
        else:
            self.transport.writelines(pieces)
        if self.writable is not None and not self.writable.done():
            await self.writable  # the client reads slower than we write: wait, and so stop reading upstream

    def _idle(self) -> None:
        """The keep-alive timer: one per connection, set again for what is left of the timeout while the
        connection was active (cheaper than a timer per request)."""
        self.idle_timer = None
        if self.transport is None:
            return
        quiet = self.front.loop.time() - self.last_active
        if not self.busy and not self.waiting and quiet >= KEEPALIVE_TIMEOUT_S:
            self.transport.close()
            return
        wait = KEEPALIVE_TIMEOUT_S - quiet if not self.busy else KEEPALIVE_TIMEOUT_S
        self.idle_timer = self.front.loop.call_later(max(wait, 1.0), self._idle)

    def close_idle(self) -> None:
        if self.transport is not None and not self.busy:
            self.transport.close()


class Front:
    """The raw front on host:port and the aiohttp application behind it on a loopback port; `cleanup()`
    closes both, as `web.AppRunner.cleanup()` did."""

    def __init__(
        self, router: Forwarder, back: web.AppRunner, back_url: str, max_body_bytes: int, grace_s: float
    ) -> None:
        self.router = router
        self.grace_s = grace_s
        self.loop = asyncio.get_running_loop()
        self.back = back
        self.back_url = back_url
        self.max_body_bytes = max_body_bytes
        self.server: asyncio.Server | None = None
        self.connections: set[_Connection] = set()
        self._back_pool = EnginePool()

    @property
    def port(self) -> int:
        """The port the front listens on: the one asked for, or the one the kernel chose for port 0."""
        assert self.server is not None and self.server.sockets, "the front is not serving"
        return int(self.server.sockets[0].getsockname()[1])

    async def to_back(self, request: FrontRequest) -> FrontResponse | web.Response:
        """Relay a request the front does not serve itself to the aiohttp application behind it."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            upstream = await self._back_pool.request(
                self.back_url, request.method, request.rel_url, headers, request.body, 5.0, 3600.0
            )
        except EngineUnreachable as error:
            body = {"error": {"message": f"the router's application: {error}", "type": "internal_error"}}
            return web.json_response(body, status=502)
        try:
            return await self._relay(request, upstream)
        finally:
            upstream.close()

    async def _relay(self, request: FrontRequest, upstream: EngineResponse) -> FrontResponse:
        headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS]
        out = FrontResponse(request, upstream.status, headers)
        last = b""
        async for chunk in upstream.chunks():
            if upstream.ended:
                last = chunk
            else:
                await out.write(chunk)
        await out.write_eof(last)
        return out

    async def cleanup(self) -> None:
        """Stop listening, give running requests `grace_s` to end, cut the rest, then stop the application."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.close_idle()
        tasks = [c.task for c in self.connections if c.task is not None and c.busy]
        if tasks:
            await asyncio.wait(tasks, timeout=self.grace_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()  # connection_lost cancels its request's task
        left = [t for t in tasks if not t.done()]
        if left:  # their handlers unwind (engine connections dropped, slots released) before the pools close
            await asyncio.wait(left, timeout=self.grace_s)
        self._back_pool.close()
        await self.back.cleanup()


async def start_front(
    router: Forwarder,
    app: web.Application,
    host: str,
    port: int,
    start_app: Callable[[web.Application, socket.socket], Awaitable[web.AppRunner]],
    max_body_bytes: int,
    grace_s: float,
) -> Front:
    """Serve `app` behind the raw front: the front on host:port, the application on a loopback port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    back = await start_app(app, sock)
    front = Front(router, back, f"http://127.0.0.1:{sock.getsockname()[1]}", max_body_bytes, grace_s)
    loop = asyncio.get_running_loop()
    try:
        front.server = await loop.create_server(lambda: _Connection(front), host, port, reuse_address=True)
    except BaseException:
        await back.cleanup()
        raise
    return front
