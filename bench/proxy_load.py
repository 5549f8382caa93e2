"""The two ends of `specfleet bench router`: a fake engine that streams as fast as it can, and a load
generator cheaper than the proxies it measures. Both are raw asyncio protocols (no HTTP framework), so the
measured cost is the proxy's and not theirs.

- `Upstream`: answers every `/v1/...` request with a prepared Server-Sent Events stream of `CHUNKS` chunked
  events, one `write` each (one send each: an engine that emits tokens one at a time, without pausing),
  or, for a request that asks for `stream_options.include_usage` (the gateway's tenant gate does), with the
  same events carrying `"usage":null` and a usage event before `[DONE]`, as the engine sends them;
  `GET /v1/models` with its one model card (the gateway asks for the name the engine serves), and anything
  else (`/ready`, `/health`) with a small JSON 200. HTTP/1.1 keep-alive; request bodies must carry
  Content-Length (every client here sends one).
- `Connection`: one keep-alive client connection; `request()` sends one prepared request and returns its
  latency, from the write to the last byte of the response, after checking the status and that all
  `CHUNKS` events arrived.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import cast

CHUNKS = 64  # events per streamed response (issue 39: "streams 64 chunks"); the last is `data: [DONE]`
EVENT = {
    "id": "cmpl-bench",
    "object": "text_completion",
    "created": 0,
    "model": "bench",
    "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}],
}
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
SMALL_200 = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'
_MODELS = json.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}).encode()
MODELS_200 = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_MODELS),
    _MODELS,
)
MAX_HEAD_BYTES = 64 * 1024  # a request head larger than this is not one of ours: the connection is closed


def sse_chunks(count: int = CHUNKS, usage: bool = False) -> list[bytes]:
    """`count` HTTP chunks, each one SSE event (an OpenAI completion chunk; `[DONE]` last), and the end;
    with `usage`, every chunk says `"usage":null` and one more event before `[DONE]` carries the usage."""
    event = {**EVENT, "usage": None} if usage else EVENT
    events = [f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode() for _ in range(count - 1)]
    if usage:
        total = {"prompt_tokens": 8, "completion_tokens": count - 1, "total_tokens": count + 7}
        last = {**EVENT, "choices": [], "usage": total}
        events.append(f"data: {json.dumps(last, separators=(',', ':'))}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]


def content_length(head: bytes) -> int:
    """The Content-Length of a request head (0 when absent); a chunked request body is refused."""
    lower = head.lower()
    if b"\ntransfer-encoding:" in lower:
        raise ValueError("the fake upstream takes Content-Length bodies only, not Transfer-Encoding")
    at = lower.find(b"\ncontent-length:")
    if at < 0:
        return 0
    end = lower.find(b"\r\n", at + 1)
    return int(lower[at + 16 : end if end >= 0 else None])


class Upstream(asyncio.Protocol):
    """One connection to the fake engine: parse request heads, answer each with the prepared response."""

    def __init__(self, chunks: list[bytes], usage_chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.usage_chunks = usage_chunks
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end]
            try:
                size = end + 4 + content_length(head)
            except ValueError:
                self.transport.close()
                return
            if len(self.buffer) < size:
                return
            body, self.buffer = self.buffer[end + 4 : size], self.buffer[size:]
            target = head.split(b" ", 2)[1]
            if target == b"/v1/models":
                self.transport.write(MODELS_200)
            elif target.startswith(b"/v1/"):
                self.transport.write(STREAM_HEAD)
                asks = b'"include_usage":true' in body.replace(b" ", b"")
                for chunk in self.usage_chunks if asks else self.chunks:
                    self.transport.write(chunk)
            else:
                self.transport.write(SMALL_200)
        if len(self.buffer) > MAX_HEAD_BYTES:
            self.transport.close()


async def start_upstream(host: str = "127.0.0.1", port: int = 0) -> tuple[asyncio.Server, int]:
    chunks, usage_chunks = sse_chunks(), sse_chunks(usage=True)
    server = await asyncio.get_running_loop().create_server(
        lambda: Upstream(chunks, usage_chunks), host, port
    )
    return server, server.sockets[0].getsockname()[1]


def completion_request(host: str, port: int, prompt: str, api_key: str | None = None) -> bytes:
    """A streamed completion request, as an OpenAI client sends it (the router hashes the prompt), with the
    client's `Authorization` when it has a key."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": CHUNKS, "stream": True}).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\n{auth}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class BadResponse(Exception):
    """A response that is not the fake upstream's stream, passed through whole: the run is void."""


class ResponseReader:
    """Finds the end of one HTTP/1.1 response (chunked or Content-Length) in the bytes as they arrive."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.body_at = -1  # where the body starts, once the head is in
        self.length = -1  # the body's Content-Length; -1: chunked

    def feed(self, data: bytes) -> bool:
        """Add bytes; True once the response is complete."""
        self.data += data
        if self.body_at < 0:
            end = self.data.find(b"\r\n\r\n")
            if end < 0:
                return False
            self.body_at = end + 4
            head = bytes(self.data[:end]).lower()
            if b"\ntransfer-encoding: chunked" not in head:
                at = head.find(b"\ncontent-length:")
                if at < 0:
                    raise BadResponse(f"neither chunked nor Content-Length: {bytes(self.data[:end])!r}")
                stop = head.find(b"\r\n", at + 1)
                self.length = int(head[at + 16 : stop if stop >= 0 else None])
        if self.length >= 0:
            return len(self.data) >= self.body_at + self.length
        # the last chunk: our events hold no CR, so CRLF 0 CRLF CRLF is the terminator and nothing else
        return self.data.endswith(b"0\r\n\r\n") and (
            len(self.data) - 5 == self.body_at or self.data[-7:-5] == b"\r\n"
        )

    def check(self, events: int) -> None:
        if not self.data.startswith(b"HTTP/1.1 200"):
            raise BadResponse(f"status line {bytes(self.data[:40])!r}")
        got = self.data.count(b"data: ", self.body_at)
        if got != events:
            raise BadResponse(f"{got} events arrived, {events} were sent")


class _ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader()
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        try:
            complete = self.reader.feed(data)
        except BadResponse as error:
            complete = True
            if self.done is not None and not self.done.done():
                self.done.set_exception(error)
        if complete and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"the server closed the connection mid-response: {exc}"))


class Connection:
    """One keep-alive client connection to host:port; reconnects when the server closed it between
    requests (a proxy's keep-alive limit)."""

    def __init__(self, host: str, port: int, request: bytes, events: int = CHUNKS) -> None:
        self.host, self.port, self.request_bytes, self.events = host, port, request, events
        self.protocol: _ClientProtocol | None = None

    async def request(self) -> float:
        """Send the request; the seconds until the last byte of a checked response."""
        loop = asyncio.get_running_loop()
        if self.protocol is None or self.protocol.transport is None:
            _, self.protocol = await loop.create_connection(_ClientProtocol, self.host, self.port)
        protocol = self.protocol
        assert protocol.transport is not None
        protocol.reader = ResponseReader()
        protocol.done = loop.create_future()
        start = time.perf_counter()
        protocol.transport.write(self.request_bytes)
        await protocol.done
        elapsed = time.perf_counter() - start
        protocol.reader.check(self.events)
        return elapsed

    def close(self) -> None:
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.close()


async def sequential(conn: Connection, count: int) -> list[float]:
    """`count` requests one after the other on one connection: latencies in seconds."""
    return [await conn.request() for _ in range(count)]


async def closed_loop(host: str, port: int, request: bytes, concurrency: int, seconds: float) -> float:
    """`concurrency` connections each sending its next request when the last one ended, for `seconds`
    (after one warm-up request each): completed requests per second."""
    conns = [Connection(host, port, request) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(c.request() for c in conns))  # connected and warm
        done = 0
        start = time.perf_counter()
        deadline = start + seconds

        async def worker(conn: Connection) -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await conn.request()
                done += 1

        await asyncio.gather(*(worker(c) for c in conns))
        return done / (time.perf_counter() - start)
    finally:
        for conn in conns:
            conn.close()
