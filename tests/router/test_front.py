"""The router's raw front (router/front.py) over real sockets: what it does itself that aiohttp's server did
(keep-alive, pipelining, chunked request bodies, Expect: 100-continue, HTTP/1.0, bad input answered and the
connection closed, a client that leaves mid-stream, Connection: close once stopping), and the paths it hands
to the aiohttp application behind it. The engines are tests/router/engines.py; the client is a raw socket
whose responses httptools parses, so every byte the front writes is checked."""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest
from aiohttp import web
from specfleet.router.front import MAX_HEAD_BYTES
from specfleet.router.proxy import MAX_BODY_BYTES

from .engines import FakeEngine, stream_forever
from .test_proxy import BODY, disconnected, run, start_router

BODY_BYTES = json.dumps(BODY).encode()


class Responses:
    """The responses read off one client connection, parsed by httptools (framing checked)."""

    def __init__(self) -> None:
        self.done: list[tuple[int, dict[str, str], bytes]] = []
        self.parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []


async def read_responses(reader: asyncio.StreamReader, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    responses = Responses()
    while len(responses.done) < count:
        data = await asyncio.wait_for(reader.read(65536), timeout=10)
        assert data, f"the connection closed after {len(responses.done)} of {count} responses"
        responses.parser.feed_data(data)
    return responses.done


def request(path: str = "/v1/completions", body: bytes = BODY_BYTES, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{extra}"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def closed(reader: asyncio.StreamReader) -> bool:
    """The front closed the connection (what is left to read ends)."""
    return await asyncio.wait_for(reader.read(), timeout=10) == b""


def test_keep_alive_pipelining_and_the_application_behind_the_front_on_one_connection():
    """Three requests one after the other, then three in one write (pipelined, one of them /metrics, which
    the aiohttp application answers): six answers in order, one connection, the engine got each body."""

    async def test() -> None:
        engine = await FakeEngine("e").start()
        router, url, runner = await start_router([engine.url])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            for _ in range(3):
                writer.write(request())
                [(status, headers, body)] = await read_responses(reader, 1)
                assert status == 200 and json.loads(body)["engine"] == "e"
                assert "close" not in headers.get("connection", "")
            metrics = b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n"
            writer.write(request("/v1/chat/completions") + metrics + request())
            answers = await read_responses(reader, 3)
            assert [a[0] for a in answers] == [200, 200, 200]
            assert json.loads(answers[0][2])["path"] == "/v1/chat/completions"
            assert (
                b'specfleet_router_requests_total{engine="%s",outcome="ok"} 4.0' % engine.url.encode()
                in (answers[1][2])
            )
            assert json.loads(answers[2][2])["path"] == "/v1/completions"
            assert engine.requests == [BODY_BYTES] * 5
        finally:
            writer.close()
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_a_chunked_request_body_with_expect_100_continue_reaches_the_engine_whole():
    async def test() -> None:
        engine = await FakeEngine("e").start()
        router, url, runner = await start_router([engine.url])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n"
                b"Expect: 100-continue\r\nContent-Type: application/json\r\n\r\n"
            )
            assert (
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
            )
            half = len(BODY_BYTES) // 2
            for piece in (BODY_BYTES[:half], BODY_BYTES[half:]):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            writer.write(b"0\r\n\r\n")
            [(status, _, body)] = await read_responses(reader, 1)
            assert status == 200 and json.loads(body)["engine"] == "e"
            assert engine.requests == [BODY_BYTES]
        finally:
            writer.close()
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_bad_input_is_answered_with_the_limit_and_the_connection_closed():
    """A request line that does not parse: 400; a head over MAX_HEAD_BYTES (one long header, or many short
    ones): 431; a Content-Length over MAX_BODY_BYTES: 413 before any of the body is read. Each answer is
    JSON naming the problem, the connection then closes, and no engine saw a request."""

    async def test() -> None:
        engine = await FakeEngine("e").start()
        router, url, runner = await start_router([engine.url])
        port = int(url.rsplit(":", 1)[1])
        many = "".join(f"X-H{i}: {'v' * 100}\r\n" for i in range(MAX_HEAD_BYTES // 100))
        cases = [
            (b"NOT A REQUEST\r\n\r\n", 400, "does not parse"),
            (request(extra=f"X-Long: {'a' * (2 * MAX_HEAD_BYTES)}\r\n"), 431, str(MAX_HEAD_BYTES)),
            (request(extra=many), 431, str(MAX_HEAD_BYTES)),
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode(),
                413,
                str(MAX_BODY_BYTES),
            ),
        ]
        try:
            for raw, status, names in cases:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(raw)
                [(got, headers, body)] = await read_responses(reader, 1)
                assert got == status, (raw[:40], got, body)
                assert headers["connection"] == "close"
                assert names in json.loads(body)["error"]["message"]
                assert await closed(reader)
                writer.close()
            assert engine.requests == []
            async with asyncio.timeout(10):  # the front still serves
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request())
                assert (await read_responses(reader, 1))[0][0] == 200
                writer.close()
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_a_client_leaving_mid_stream_releases_the_engine_connection():
    async def test() -> None:
        engine = await FakeEngine("forever", stream_forever).start()
        router, url, runner = await start_router([engine.url])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(request(body=json.dumps({**BODY, "stream": True}).encode()))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked" in head
            assert b'data: {"tick": 1}' in await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
            writer.transport.abort()  # the client goes away mid-stream
            await disconnected(router, engine)
            assert router.in_flight == 0
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_http_1_0_and_a_stopping_router_close_the_connection_after_the_answer():
    async def test() -> None:
        engine = await FakeEngine("e").start()
        router, url, runner = await start_router([engine.url])
        port = int(url.rsplit(":", 1)[1])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request().replace(b"HTTP/1.1", b"HTTP/1.0"))
            raw = await asyncio.wait_for(reader.read(), 10)  # to the close: no chunked framing on 1.0
            head, _, body = raw.partition(b"\r\n\r\n")
            assert b"Transfer-Encoding" not in head and b"Connection: close" in head
            assert json.loads(body)["engine"] == "e"
            writer.close()

            router.stopping = True  # SIGTERM came (router/shutdown.py): answered, then closed
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request())
            [(status, headers, _)] = await read_responses(reader, 1)
            assert status == 200 and headers["connection"] == "close"
            assert await closed(reader)
            writer.close()
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_a_head_request_and_an_unknown_path_get_the_applications_answers():
    async def test() -> None:
        engine = await FakeEngine("e").start()
        router, url, runner = await start_router([engine.url])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(b"GET /nowhere HTTP/1.1\r\nHost: r\r\n\r\nGET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            [(missing, _, _), (health, _, body)] = await read_responses(reader, 2)
            assert missing == 404 and health == 200 and json.loads(body) == {"status": "ok"}
            writer.write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\nGET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            data = b""  # read raw: a HEAD answer's head has no body after it, whatever it says
            while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"0\r\n\r\n"):
                data += await asyncio.wait_for(reader.read(65536), 10)
            first, _, second = data.partition(b"\r\n\r\n")
            assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")  # HEAD: no body
        finally:
            writer.close()
            await runner.cleanup()
            await engine.stop()

    run(test)


STREAM_CAP = 64 * 1024 * 1024  # what the fast engine below writes at most, read or not
WRITTEN = [0]  # what it wrote so far


async def stream_fast(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    """64 KiB events as fast as the router takes them, up to STREAM_CAP; the bytes written so far in
    WRITTEN."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    event = b"data: " + b"x" * (64 * 1024) + b"\n\n"
    for _ in range(STREAM_CAP // len(event)):
        await out.write(event)  # waits while the router does not read (aiohttp's drain)
        WRITTEN[0] += len(event)
    await out.write_eof()
    return out


@pytest.mark.parametrize("extra", [{}, {"n": 2}], ids=["relayed", "passed-through"])
def test_a_client_that_does_not_read_holds_the_engine_back(extra: dict[str, int]):
    """Backpressure: a client that stops reading fills its socket, the front's writes wait, the router stops
    reading the engine, and the engine's writes wait in turn: what the engine wrote stalls far below what it
    would write if the router buffered for the client. Alike for a resumable stream (relayed event by event)
    and one that is not (passed through as the engine framed it, from the engine connection's callback)."""

    async def test() -> None:
        WRITTEN[0] = 0
        engine = await FakeEngine("fast", stream_fast).start()
        router, url, runner = await start_router([engine.url])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(request(body=json.dumps({**BODY, "stream": True, **extra}).encode()))
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # then the client reads no more
            last, stalled = -1, False
            for _ in range(50):
                await asyncio.sleep(0.2)
                if WRITTEN[0] == last:
                    stalled = True
                    break
                last = WRITTEN[0]
            assert stalled and 0 < WRITTEN[0] < STREAM_CAP // 2, WRITTEN[0]
        finally:
            writer.transport.abort()
            await runner.cleanup()
            await engine.stop()

    run(test)
