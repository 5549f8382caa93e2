"""The router's hop to the engines: keep-alive HTTP/1.1 connections over raw asyncio transports.

aiohttp's client hands each HTTP chunk of a streamed body through Python (a parser callback, a StreamReader
split, a flow-control pause and resume): a 64-token SSE stream cost the router ~65 such rounds and most of
its CPU per request (`specfleet bench router`, docs/results/2026-12-03-bench-router.md). Here httptools
(llhttp, in C) parses the response and each body piece costs one list append; whatever arrived by the time
the proxy wakes leaves as one write, so the router's cost follows its reads, not the engine's chunks.

- A connection is reused for the next request to the same engine once its response ended and the engine
  kept it alive; idle ones close after `KEEPALIVE_S`, before the engine's server closes them.
- Any failure before the response head (refused, reset, closed, timed out) is `EngineUnreachable`: the
  proxy may send the request to another engine. After the head, a failure is `EngineBroken`.
- `close()` before the end drops the connection, which the engine sees as a disconnect and aborts.
- A request sent with `raw=True` goes over a connection whose parser has no body callback: the body comes
  out of `chunks()` as the engine framed it (chunked framing included), one piece per wake-up, with no
  per-chunk work in Python; llhttp still checks the framing and finds the message's end. The proxy relays
  such a body as it came when nothing reads its events (router/proxy.py), through `EngineResponse.pipe`:
  each read goes to the client from `data_received` itself, without waking the proxy's task. The stream
  relay (router/resume.py) pipes a decoding connection's body alike: each read's chunk data, joined.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import SimpleNamespace
from typing import cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from .chunked import dechunk

# Idle connections older than this are not reused: uvicorn, the engine's server, closes them after 5 s
# (its timeout_keep_alive default), and a request written onto one it is closing fails.
KEEPALIVE_S = 4.0
# Body bytes held for a client that reads slower than the engine streams before reading from the engine
# pauses (TCP then slows the engine down): a few hundred SSE events, far above one read's worth.
HIGH_WATER_BYTES = 256 * 1024
SKIPPED_REQUEST_HEADERS = frozenset({"expect"})  # the body is sent at once: no 100-continue round trip


class EngineUnreachable(Exception):
    """No response head came from the engine: nothing reached the client, the request may go elsewhere."""


class EngineBroken(Exception):
    """The engine's connection failed after its response head: the stream is cut."""


class _Connection(asyncio.Protocol):
    """One engine connection: the transport's and the parser's callbacks fill what the proxy reads."""

    def __init__(self, raw: bool = False) -> None:
        self.transport: asyncio.Transport | None = None
        # raw: the body is kept as it arrives, framing and all; httptools calls back only for what it is given
        # (it looks the callbacks up once), so a raw connection's parser gets no `on_body`, and a decoding
        # one gets the list's own `append` (a C method: no Python frame for each of a stream's chunks)
        self.raw = raw
        self.pieces: list[bytes] = []  # the same list for every response on this connection: see reset
        callbacks = SimpleNamespace(
            on_header=self.on_header,
            on_headers_complete=self.on_headers_complete,
            on_message_complete=self.on_message_complete,
        )
        if not raw:
            callbacks.on_body = self.pieces.append
        self.parser = httptools.HttpResponseParser(callbacks)
        self.error: BaseException | None = None  # the connection is unusable: why
        self.idle_since = 0.0
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.pieces.clear()  # cleared, not replaced: the parser appends to this list
        self.size = 0  # body bytes kept in pieces (a decoding connection counts its reads: a bound above)
        self.received = False  # any byte of this response
        self.head_bytes = b""  # raw: the response head's bytes read so far, until its end is known
        # raw, while EngineResponse.pipe runs: each read's body bytes go here from data_received, with no
        # wake-up of the proxy's task; it answers whether the client is full (reading then pauses)
        self.sink: Callable[[bytes], bool] | None = None
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- transport ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.received = True
        in_body = self.head_done
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self.fail(EngineBroken(f"the engine's response does not parse: {error}"))
            return
        if self.raw:
            body = data if in_body else self.raw_head(data)
            if body and self.sink is not None:
                self.to_sink(body)
                return
            if body:
                self.pieces.append(body)
                self.size += len(body)
        elif self.pieces:  # decoded: this read's chunks' data (the parser appended it)
            if self.sink is not None:
                pieces = self.pieces
                body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                self.to_sink(body)
                return
            self.size += len(data)
        if self.size > HIGH_WATER_BYTES and not self.complete and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self.wake()

    def to_sink(self, body: bytes) -> None:
        """One read's body bytes to the sink (EngineResponse.pipe); the proxy's task wakes only for the
        answer's end or a full sink (reading pauses until it drains)."""
        assert self.sink is not None
        if self.sink(body) and not self.complete and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        if self.complete or self.paused:
            self.wake()

    def raw_head(self, data: bytes) -> bytes:
        """A raw connection's read before the body began: what follows the head's end is body."""
        if not self.head_done:
            self.head_bytes += data
            return b""
        # The head ended in this read: at its first empty line (the request had no Expect, so no 1xx head)
        head = self.head_bytes + data if self.head_bytes else data
        self.head_bytes = b""
        return head[head.index(b"\r\n\r\n") + 4 :]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = exc or ConnectionResetError("the engine closed the connection")
        self.transport = None
        self.wake()

    def fail(self, error: BaseException) -> None:
        """Give up on this connection (a timeout, a bad response, the proxy's client left)."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self.wake()

    # -- parser ------------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser resets after the message

    # -- the proxy's side ---------------------------------------------------------------------------------
    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def changed(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def take(self) -> bytes:
        """Every body byte that arrived since the last take, as one piece."""
        data = self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)
        self.pieces.clear()
        self.size = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


class EngineResponse:
    """The engine's answer: `status` and `headers` now, the body from `chunks()`; `close()` always."""

    def __init__(
        self, pool: EnginePool, key: str, conn: _Connection, timer: asyncio.TimerHandle, head_only: bool
    ) -> None:
        self._pool, self._key, self._conn, self._timer = pool, key, conn, timer
        self.status = conn.status
        self.headers = CIMultiDict(conn.headers)
        # the body comes out of chunks() with its chunked framing (a raw connection's chunked answer)
        self.framed = conn.raw and "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if head_only:  # a HEAD response has no body whatever its Content-Length says: not reused after it
            conn.complete = True
            conn.error = ConnectionAbortedError("not reused after a HEAD request")

    @property
    def ended(self) -> bool:
        """The whole body arrived and every byte of it was taken: the last piece is out of `chunks()`."""
        return self._conn.complete and not self._conn.pieces

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one piece per wake-up: decoded from its chunked framing, or with the
        framing as the engine sent it where `framed`."""
        conn = self._conn
        while True:
            if conn.pieces:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                error = conn.error
                raise (
                    error
                    if isinstance(error, TimeoutError)
                    else EngineBroken(f"{type(error).__name__}: {error}")
                )
            else:
                await conn.changed()

    async def pipe(
        self,
        sink: Callable[[bytes], bool],
        drained: Callable[[], Awaitable[None]],
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        """The body to `sink` until its end (as `chunks()` gives it: framed where `framed`): each read's bytes
        from the connection's own callback, with no wake-up of this task per read (it wakes for the end, a
        failure, or a sink that is full: then reading waits for `drained`). `sink(data)` says whether it is
        full; one that wants no more (`stopped()`, asked when this task wakes) answers True to wake it."""
        conn = self._conn
        full = False
        if conn.pieces:  # what arrived with the head
            full = sink(conn.take())
        conn.sink = sink
        try:
            while True:
                if stopped is not None and stopped():
                    return
                if conn.complete and not conn.pieces:
                    return
                if conn.error is not None:
                    error = conn.error
                    raise (
                        error
                        if isinstance(error, TimeoutError)
                        else EngineBroken(f"{type(error).__name__}: {error}")
                    )
                if full or conn.paused:
                    await drained()
                    full = False
                    conn.take()  # nothing is kept while the sink is set: this resumes reading
                    continue
                await conn.changed()
        finally:
            conn.sink = None

    async def read(self, limit: int) -> bytes:
        """At most `limit` bytes of the body (the rest is not read: the connection is then dropped)."""
        out = b""
        async for piece in self.chunks():
            out += piece
            if len(dechunk(out) if self.framed else out) >= limit:
                break
        return (dechunk(out) if self.framed else out)[:limit]

    def close(self) -> None:
        self._timer.cancel()
        conn = self._conn
        if conn.complete and conn.error is None and conn.keep_alive:
            self._pool.put(self._key, conn)
        else:
            conn.fail(ConnectionAbortedError("the router closed the connection"))


class EnginePool:
    """Keep-alive connections per engine URL (`http://host:port`)."""

    def __init__(self) -> None:
        # per engine URL and kind (raw or decoding: a parser's callbacks are fixed when it is made)
        self._idle: dict[tuple[str, bool], list[_Connection]] = {}
        self._addresses: dict[str, tuple[str, int, bytes]] = {}

    def put(self, key: str, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault((key, conn.raw), []).append(conn)

    def _reusable(self, key: str, raw: bool) -> _Connection | None:
        idle = self._idle.get((key, raw))
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be timing out
            if conn.transport is not None and not conn.transport.is_closing() and conn.error is None:
                if now - conn.idle_since < KEEPALIVE_S:
                    return conn
            conn.fail(ConnectionAbortedError("idle too long"))
        return None

    def _address(self, url: str) -> tuple[str, int, bytes]:
        address = self._addresses.get(url)
        if address is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"engine URL {url!r}: the router speaks plain http://host:port to engines")
            address = (parts.hostname, parts.port or 80, parts.netloc.encode())
            self._addresses[url] = address
        return address

    async def request(
        self,
        url: str,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes,
        connect_timeout_s: float,
        timeout_s: float,
        raw: bool = False,
    ) -> EngineResponse:
        """Send one request to the engine at `url` and wait for its response head; `raw`: its body as the
        engine framed it (EngineResponse.framed)."""
        host, port, netloc = self._address(url)
        lines = [f"{method} {target} HTTP/1.1\r\n".encode(), b"Host: " + netloc + b"\r\n"]
        for name, value in headers.items():
            if name.lower() not in SKIPPED_REQUEST_HEADERS:
                lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        head = b"".join(lines)
        conn = self._reusable(url, raw)
        if conn is not None:
            try:
                return await self._exchange(url, conn, head, body, timeout_s, method == "HEAD")
            except EngineUnreachable:
                if conn.received:
                    raise
                # the engine closed this idle connection as the request went out: it never saw the request
        try:
            loop = asyncio.get_running_loop()
            _, fresh = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(raw), host, port), connect_timeout_s
            )
        except (OSError, TimeoutError) as error:
            raise EngineUnreachable(f"{type(error).__name__}: {error}") from error
        return await self._exchange(url, fresh, head, body, timeout_s, method == "HEAD")

    async def _exchange(
        self, key: str, conn: _Connection, head: bytes, body: bytes, timeout_s: float, head_only: bool
    ) -> EngineResponse:
        conn.reset()
        timer = asyncio.get_running_loop().call_later(
            timeout_s, conn.fail, TimeoutError(f"no complete answer from the engine within {timeout_s:.0f} s")
        )
        assert conn.transport is not None
        try:
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)  # a long prompt: not copied into one buffer with the head
            while not conn.head_done:
                if conn.error is not None:
                    raise EngineUnreachable(f"{type(conn.error).__name__}: {conn.error}")
                await conn.changed()
        except BaseException:  # unreachable, or the proxy's client left: this connection is done
            timer.cancel()
            conn.fail(ConnectionAbortedError("the request was abandoned"))
            raise
        return EngineResponse(self, key, conn, timer, head_only)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.fail(ConnectionAbortedError("the router is closing"))
        self._idle.clear()
