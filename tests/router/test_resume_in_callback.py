"""The stream relay run from the engine connection's read callback (router/resume.py `_RelayNow`, upstream.py's
`pipe` on a decoding connection), over real sockets: a client that reads slowly fills the router's side of
its connection, so reading from the engine pauses and resumes; the engine's connection then breaks and the
stream goes on from another engine. The client reads every event once, in order, without the token ids,
and the second engine is asked to go on after exactly the tokens the client has."""

from __future__ import annotations

import asyncio
import json
import socket

from specfleet.router.chunked import dechunk
from specfleet.router.front import FrontResponse

from .test_pass_through import HEAD, RawEngine, answer_head, chunked_body, post
from .test_proxy import run, start_router

# Events large enough that the answer (about 6 MB) outgrows what loopback's socket buffers hold for a client
# that has not begun to read (a 4 KiB receive buffer here): the router's writes must wait for it
EVENTS = 6000
PAD = "x" * 1000


def event(i: int, ids: bool) -> bytes:
    choice: dict[str, object] = {"index": 0, "text": f" {i}{PAD}", "logprobs": None, "finish_reason": None}
    if ids:
        choice["token_ids"] = [i]
    data = {"id": "first", "created": 1, "choices": [choice]}
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def framed(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


def test_a_slow_client_pauses_the_relay_and_a_cut_after_it_still_resumes_token_for_token(monkeypatch):
    cut_at = EVENTS - 10
    # the first engine sends all but the last 10 events in one write, then its connection breaks
    first = RawEngine(lambda n, body: ([HEAD + framed([event(i, True) for i in range(cut_at)])], True))
    rest = [event(i, True) for i in range(cut_at, EVENTS)] + [b"data: [DONE]\n\n"]
    second = RawEngine(lambda n, body: ([HEAD + framed(rest) + b"0\r\n\r\n"], False))
    drained = []
    wait = FrontResponse.drained

    async def counted(self: FrontResponse) -> None:
        drained.append(1)
        await wait(self)

    monkeypatch.setattr(FrontResponse, "drained", counted)  # counts the waits; the wait itself is real

    async def test() -> None:
        a, b = await first.start(), await second.start()
        router, front_url, runner = await start_router([a, b])
        router.policy._next = sorted([a, b]).index(a)  # the first engine first
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(front_url.rsplit(":", 1)[1])))
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            await post(writer, {"prompt": "hi", "max_tokens": EVENTS, "stream": True})
            await asyncio.sleep(0.5)  # the client reads nothing yet: the router's writes fill up
            await answer_head(reader)
            body = dechunk(await chunked_body(reader))
        finally:
            writer.close()
            await runner.cleanup()
            await first.stop()
            await second.stop()
        assert drained, "the client never filled up: the test did not pause the relay"
        assert body == b"".join(event(i, False) for i in range(EVENTS)) + b"data: [DONE]\n\n"
        assert second.requests[0][1]["resume_token_ids"] == list(range(cut_at))
        assert router.metrics.resumed.labels("broken")._value.get() == 1

    run(test)
