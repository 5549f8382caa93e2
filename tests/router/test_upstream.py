"""The router's engine connections (router/upstream.py) against raw servers on loopback: a streamed body
arrives whole and in order however it is chunked, connections are reused while the engine keeps them alive
and not after, an engine that closes an idle connection as the request goes out costs a new connection
and not the request, and every failure says which side of the response head it happened on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from specfleet.router import upstream
from specfleet.router.upstream import EngineBroken, EnginePool, EngineUnreachable

Answer = Callable[[int, int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(64)] + [b"data: [DONE]\n\n"]


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


class Engine:
    """A raw HTTP server: `answer(connection number, request number on it, reader, writer)` returns
    whether to keep the connection open; `requests` keeps what arrived."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []

    async def start(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            number, served = self.connections, 0
            try:
                while True:
                    self.requests.append(await read_request(reader))
                    served += 1
                    if not await self.answer(number, served, reader, writer):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


async def stream_in_pieces(
    number: int, served: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> bool:
    body = chunked(EVENTS)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Request-Id: r1\r\n")
    writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(body), 97):  # chunk edges and read edges fall anywhere
        writer.write(body[i : i + 97])
        await writer.drain()
    return True


async def fetch(
    pool: EnginePool, url: str, body: bytes = b'{"prompt": "hi"}', timeout_s: float = 10.0
) -> tuple[int, bytes]:
    response = await pool.request(
        url, "POST", "/v1/completions?x=1", {"Content-Type": "application/json"}, body, 5.0, timeout_s
    )
    try:
        return response.status, b"".join([piece async for piece in response.chunks()])
    finally:
        response.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=30))


def test_a_stream_arrives_whole_in_order_and_its_connection_is_reused() -> None:
    async def test() -> None:
        engine = Engine(stream_in_pieces)
        url = await engine.start()
        pool = EnginePool()
        for _ in range(3):
            status, body = await fetch(pool, url)
            assert status == 200 and body == b"".join(EVENTS)
        assert engine.connections == 1 and len(engine.requests) == 3
        head = engine.requests[0]
        assert head.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Content-Length: 16\r\n" in head and head.endswith(b'\r\n\r\n{"prompt": "hi"}')
        response = await pool.request(url, "POST", "/v1/completions", {}, b"{}", 5.0, 10.0)
        assert response.headers["x-request-id"] == "r1"  # headers keep their values, names match any case
        response.close()
        assert engine.connections == 1
        pool.close()
        engine.server.close()

    run(test)


def test_a_response_closed_before_its_end_drops_its_connection() -> None:
    async def first_event_then_wait(
        number: int, served: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS[:1])[:-5])
        await writer.drain()
        await reader.read()  # until the router drops the connection (the engine then aborts the request)
        return False

    async def test() -> None:
        engine = Engine(first_event_then_wait)
        url = await engine.start()
        pool = EnginePool()
        for _ in range(2):
            response = await pool.request(url, "POST", "/v1/completions", {}, b"{}", 5.0, 10.0)
            assert await anext(response.chunks()) == EVENTS[0]
            response.close()
        assert engine.connections == 2

    run(test)


def test_idle_connections_past_the_keepalive_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "KEEPALIVE_S", 0.05)

    async def test() -> None:
        engine = Engine(stream_in_pieces)
        url = await engine.start()
        pool = EnginePool()
        await fetch(pool, url)
        await asyncio.sleep(0.1)
        await fetch(pool, url)
        assert engine.connections == 2

    run(test)


def test_an_engine_that_closes_an_idle_connection_as_the_request_arrives_costs_a_new_connection() -> None:
    async def close_the_second_on_the_first(
        number: int, served: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if number == 1 and served == 2:
            return False  # closes without a byte of answer, as a keep-alive timeout does
        return await stream_in_pieces(number, served, reader, writer)

    async def test() -> None:
        engine = Engine(close_the_second_on_the_first)
        url = await engine.start()
        pool = EnginePool()
        assert (await fetch(pool, url))[0] == 200
        assert (await fetch(pool, url))[0] == 200
        assert engine.connections == 2 and len(engine.requests) == 3

    run(test)


def test_failures_before_the_head_are_unreachable_and_after_it_broken() -> None:
    async def head_then_close(
        number: int, served: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)[:50])
        await writer.drain()
        return False

    async def silent(
        number: int, served: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        await asyncio.sleep(5)
        return False

    async def garbage(
        number: int, served: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(b"SMTP ready\r\n\r\n")
        return True

    async def test() -> None:
        pool = EnginePool()
        dead = Engine(stream_in_pieces)
        dead_url = await dead.start()
        dead.server.close()
        await dead.server.wait_closed()
        with pytest.raises(EngineUnreachable, match="ConnectionRefusedError"):
            await fetch(pool, dead_url)
        with pytest.raises(EngineUnreachable, match="within 0 s"):
            await fetch(pool, await Engine(silent).start(), timeout_s=0.2)
        with pytest.raises(EngineUnreachable, match="does not parse"):
            await fetch(pool, await Engine(garbage).start())
        with pytest.raises(EngineBroken, match="closed the connection"):
            await fetch(pool, await Engine(head_then_close).start())
        with pytest.raises(ValueError, match="plain http://host:port"):
            await fetch(pool, "https://127.0.0.1:1")

    run(test)
