"""The engine's chunked answer passed through as it came (router/proxy.py's `_passes_through`, upstream.py's
raw connections, the front's framed writes), over real sockets: a raw engine that frames its body oddly
(chunks that split events, a chunk extension, upper-case sizes, pieces that split size lines) and a raw
client that reads the router's bytes. Bytes out equal bytes in; a body that breaks between two chunks ends
with the router's error event, one that breaks inside a chunk with the connection closed; and a resumable
stream on an engine whose connections were passing bodies through still resumes token for token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from specfleet.router import resume
from specfleet.router.chunked import ChunkedTail, dechunk

from .test_proxy import run, start_router

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"id":"x","choices":[{"index":%d,"text":" t%d"}]}\n\n' % (i % 2, i) for i in range(11)]
# The same events framed the way no router would: an event split over two chunks, a chunk holding two, a
# chunk extension, upper-case hexadecimal, then the last chunk
BODY = (
    b"%X\r\n%s\r\n" % (20, EVENTS[0][:20])
    + b"%X;note=1\r\n%s\r\n" % (len(EVENTS[0]) - 20, EVENTS[0][20:])
    + b"".join(
        b"%X\r\n%s\r\n" % (len(a + b), a + b) for a, b in zip(EVENTS[1::2], EVENTS[2::2], strict=False)
    )
    + b"%x\r\n%s\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")
    + b"0\r\n\r\n"
)
NOT_RESUMABLE = {"prompt": "hi", "max_tokens": 12, "stream": True, "n": 2}


def pieces(data: bytes, size: int) -> list[bytes]:
    """`data` cut every `size` bytes: through size lines, CRLFs and events alike."""
    return [data[i : i + size] for i in range(0, len(data), size)]


class RawEngine:
    """An engine as bytes: `answer(request number, request body)` gives the pieces to send and whether to
    close the connection after them; each piece is written and drained alone, so the router reads them
    apart."""

    def __init__(self, answer: Callable[[int, dict[str, object]], tuple[list[bytes], bool]]) -> None:
        self.answer = answer
        self.requests: list[tuple[dict[str, str], dict[str, object]]] = []
        self.connections = 0

    async def start(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode().split("\r\n")[1:]
                    headers = {
                        k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)
                    }
                    body = json.loads(await reader.readexactly(int(headers["content-length"])))
                    self.requests.append((headers, body))
                    out, close = self.answer(len(self.requests), body)
                    for piece in out:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.002)
                    if close:
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def post(writer: asyncio.StreamWriter, body: dict[str, object]) -> None:
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    await writer.drain()


async def answer_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nTransfer-Encoding: chunked\r\n" in head, head
    return head


async def chunked_body(reader: asyncio.StreamReader) -> bytes:
    """A whole chunked body as it came on the wire (framing included), read by its framing."""
    out = b""
    while True:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";")[0], 16)
        out += line
        if size == 0:
            return out + await reader.readexactly(2)  # no trailers here: the final CRLF
        out += await reader.readexactly(size + 2)


def test_the_engines_chunked_body_reaches_the_client_byte_for_byte():
    engine = RawEngine(lambda number, body: ([HEAD, *pieces(BODY, 7 + number)], False))

    async def test() -> None:
        url = await engine.start()
        router, front_url, runner = await start_router([url])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(front_url.rsplit(":", 1)[1]))
        try:
            for _ in range(2):  # two answers on one client connection and one engine connection
                await post(writer, NOT_RESUMABLE)
                await answer_head(reader)
                assert await chunked_body(reader) == BODY
            assert engine.connections == 1
            assert resume.TOKEN_IDS_HEADER not in engine.requests[0][0]  # no relay: nothing reads events
            assert router.metrics.requests.labels(url, "ok")._value.get() == 2
        finally:
            writer.close()
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_a_body_broken_between_chunks_ends_with_the_error_event_and_inside_one_with_the_connection():
    whole = BODY.index(EVENTS[7]) + 10  # inside a chunk
    between = BODY.index(EVENTS[5] + EVENTS[6]) + 2 * len(EVENTS[5]) + 2  # after a chunk's CRLF
    engine = RawEngine(lambda number, body: ([HEAD, BODY[: between if number == 1 else whole]], True))

    async def test() -> None:
        url = await engine.start()
        _, front_url, runner = await start_router([url])
        port = int(front_url.rsplit(":", 1)[1])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await post(writer, NOT_RESUMABLE)
            await answer_head(reader)
            body = await chunked_body(reader)
            assert body.startswith(BODY[:between])
            error = dechunk(body[between:]).split(b"\n\n")[0]
            assert b"cannot be resumed: a request with n=2 is not resumable" in error
            assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await post(writer, NOT_RESUMABLE)
            await answer_head(reader)
            assert await asyncio.wait_for(reader.read(), 10) == BODY[:whole]  # then closed: no chunk ends it
            writer.close()
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def model_answer(body: dict[str, object], cut_after: int | None) -> list[bytes]:
    """A stand-in engine's stream: output token i is " t<i>" (id 100 + i), going on after the request's
    resume_token_ids, with the token ids the router asked for; cut (no end) after `cut_after` events."""
    done = list(body.get("resume_token_ids") or [])
    total = int(body["max_tokens"])
    events = []
    for i in range(len(done), total):
        finish = "length" if i == total - 1 else None
        choice = {"index": 0, "text": f" t{i}", "finish_reason": finish, "token_ids": [100 + i]}
        events.append(
            b"data: " + json.dumps({"id": "x", "created": 1, "choices": [choice]}).encode() + b"\n\n"
        )
    events.append(b"data: [DONE]\n\n")
    framed = [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    return [HEAD, *(framed if cut_after is None else framed[:cut_after])]


def test_a_resumable_stream_after_passed_through_answers_resumes_token_for_token():
    stream = {"prompt": "hi", "max_tokens": 10, "stream": True}
    # The first engine passes a body through, then cuts a resumable stream in the middle of an event
    first = RawEngine(
        lambda n, body: (
            ([HEAD, *pieces(BODY, 9)], False)
            if n == 1
            else (model_answer(body, 4)[:-1] + [b"5\r\ndata"], True)
        )
    )
    second = RawEngine(lambda n, body: (model_answer(body, None), False))

    async def test() -> None:
        a, b = await first.start(), await second.start()
        router, front_url, runner = await start_router([a, b])
        port = int(front_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            router.policy._next = sorted([a, b]).index(a)
            await post(writer, NOT_RESUMABLE)
            await answer_head(reader)
            assert await chunked_body(reader) == BODY
            router.policy._next = sorted([a, b]).index(a)
            await post(writer, stream)
            await answer_head(reader)
            resumed = dechunk(await chunked_body(reader))
            # the undisturbed stream, from the second engine alone
            router.policy._next = sorted([a, b]).index(b)
            await post(writer, stream)
            await answer_head(reader)
            undisturbed = dechunk(await chunked_body(reader))
            assert b"token_ids" not in undisturbed and undisturbed.endswith(b"data: [DONE]\n\n")
            assert resumed == undisturbed
            assert second.requests[0][1]["resume_token_ids"] == [100, 101, 102]
            assert first.connections == 2  # the resumable stream did not take the passed-through connection
            assert router.metrics.resumed.labels("broken")._value.get() == 1
        finally:
            writer.close()
            await runner.cleanup()
            await first.stop()
            await second.stop()

    run(test)


def chunk_starts(body: bytes) -> set[int]:
    """Where each chunk of `body` begins, the last one's included (a plain walk of the framing)."""
    starts, at = set(), 0
    while True:
        starts.add(at)
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return starts
        at = end + 2 + size + 2


def test_the_tail_knows_where_a_body_stopped_however_it_was_read(monkeypatch):
    starts = chunk_starts(BODY)
    for walk_bytes in (10**6, 16):  # walked only when asked, and walked as it goes
        monkeypatch.setattr("specfleet.router.chunked.WALK_BYTES", walk_bytes)
        for size in (1, 2, 5, 64):
            tail, seen = ChunkedTail(), 0
            for piece in pieces(BODY, size):
                tail.add(piece)
                seen += len(piece)
                assert tail.at_boundary() == (seen in starts), (
                    walk_bytes,
                    size,
                    seen,
                )
    assert dechunk(BODY) == b"".join(EVENTS) + b"data: [DONE]\n\n"
    assert dechunk(BODY[:40]) == EVENTS[0][:23]  # a partial chunk: its data so far


def test_a_chunked_503_read_for_the_retry_message_is_read_without_its_framing():
    busy = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    engines = [
        RawEngine(lambda n, body: ([busy, b"3\r\nbus\r\n", b"1;x=y\r\ny\r\n0\r\n\r\n"], False)) for _ in "ab"
    ]

    async def test() -> None:
        urls = [await engine.start() for engine in engines]
        _, front_url, runner = await start_router(urls)
        reader, writer = await asyncio.open_connection("127.0.0.1", int(front_url.rsplit(":", 1)[1]))
        try:
            await post(writer, NOT_RESUMABLE)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 502 ")
            error = json.loads(dechunk(await chunked_body(reader)))["error"]["message"]
            assert error.endswith("last error: engine answered 503: busy"), error
        finally:
            writer.close()
            await runner.cleanup()
            for engine in engines:
                await engine.stop()

    run(test)
