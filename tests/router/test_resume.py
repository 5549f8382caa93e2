"""Resuming a stream cut after its first byte (router/resume.py): which requests qualify, how the relay
reads the engines' token ids and cuts, and one resume over real sockets with stand-in engines (the real
engines' run is tests/router/test_resume_engines.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from specfleet.engine.server import resume as engine_resume
from specfleet.router import resume
from specfleet.router.resume import StreamRelay, plan

from .engines import FakeEngine
from .test_proxy import run, start_router

STREAM = {"prompt": "hi", "max_tokens": 8, "stream": True}


def event(data: object) -> bytes:
    """An SSE event as the engine writes it (compact JSON: the relay's byte path reads that)."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def chunk(rid: str, text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids}
    return event({"id": rid, "created": 1 if rid == "a" else 2, "choices": [choice]})


def test_the_router_and_the_engine_name_the_same_header():
    assert resume.TOKEN_IDS_HEADER == engine_resume.TOKEN_IDS_HEADER


def test_plan_takes_plain_streams_and_names_what_stops_the_others():
    body = json.dumps(STREAM).encode()
    assert plan("completions", "POST", body, 2) == (STREAM, None)
    assert plan("chat/completions", "POST", json.dumps({**STREAM, "n": 1}).encode(), 2)[0] is not None
    assert plan("completions", "POST", json.dumps({**STREAM, "stream": False}).encode(), 2) == (None, None)
    assert plan("embeddings", "POST", body, 2) == (None, None)
    assert plan("completions", "POST", body, 0)[1] == "the router resumes no stream (--max-resumes 0)"
    for field, value in [("n", 2), ("best_of", 2), ("logprobs", 1), ("echo", True), ("tools", [{}])]:
        parsed, why = plan("completions", "POST", json.dumps({**STREAM, field: value}).encode(), 2)
        assert parsed is None and why is not None and why.startswith(f"a request with {field}=")
    batch = json.dumps({**STREAM, "prompt": ["a", "b"]}).encode()
    assert plan("completions", "POST", batch, 2)[1] is not None


def test_relay_strips_token_ids_keeps_the_first_identity_and_cuts_on_abort():
    relay = StreamRelay(dict(STREAM), (None, set(), {}))
    first = chunk("a", "He", [5, 6]) + chunk("a", "llo", [7])[:20]  # the second event split over reads
    out = relay.feed(first)
    assert json.loads(out[6:])["choices"][0] == {"index": 0, "text": "He", "finish_reason": None}
    out = relay.feed(chunk("a", "llo", [7])[20:])
    assert relay.token_ids == [5, 6, 7] and b"token_ids" not in out
    assert relay.feed(chunk("a", "", [], "abort") + b"data: [DONE]\n\n") == b""
    assert relay.cut == "aborted" and not relay.finished and not relay.done
    assert json.loads(relay.resumed_body()) == {**STREAM, "resume_token_ids": [5, 6, 7]}
    relay.next_engine()
    out = relay.feed(chunk("b", " world", [8, 9], "length") + b"data: [DONE]\n\n")
    first_event = json.loads(out.split(b"\n\n")[0][6:])
    assert (first_event["id"], first_event["created"]) == ("a", 1)  # one stream: the first engine's id
    assert relay.finished and relay.done and relay.token_ids == [5, 6, 7, 8, 9]


def test_relay_cuts_on_the_engine_dead_error_and_resends_untouched_before_any_event():
    relay = StreamRelay(dict(STREAM), (None, set(), {}))
    dead = {"error": {"message": "down", "type": "server_error", "param": None, "code": "engine_dead"}}
    assert relay.feed(event(dead)) == b"" and relay.cut == "engine_dead"
    assert json.loads(relay.resumed_body()) == STREAM  # nothing reached the client: sent as it came


async def breaks(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    assert request.headers[resume.TOKEN_IDS_HEADER] == "1"
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(chunk("a", "He", [5, 6]))
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.close()  # the engine dies mid-stream
    return out


def test_a_stream_cut_mid_way_goes_on_from_another_engine():
    async def goes_on(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(chunk("b", "llo", [7], "length") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def test() -> None:
        a = await FakeEngine("a", breaks).start()
        b = await FakeEngine("b", goes_on).start()
        router, url, runner = await start_router([a.url, b.url])
        router.policy._next = sorted([a.url, b.url]).index(a.url)  # a first
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json=STREAM) as response:
                    body = (await response.read()).split(b"\n\n")
            texts = [json.loads(e[6:])["choices"][0]["text"] for e in body if e.startswith(b"data: {")]
            assert texts == ["He", "llo"] and body[-2] == b"data: [DONE]"
            assert {json.loads(e[6:])["id"] for e in body if e.startswith(b"data: {")} == {"a"}
            assert json.loads(b.requests[-1])["resume_token_ids"] == [5, 6]
            assert router.metrics.resumed.labels("broken")._value.get() == 1
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()

    run(test)


def test_a_stream_that_cannot_be_resumed_ends_with_an_error_saying_why():
    async def breaks(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
        assert resume.TOKEN_IDS_HEADER not in request.headers
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(event({"id": "a", "choices": [{"index": 0, "text": "x"}]}))
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return out

    async def test() -> None:
        a = await FakeEngine("a", breaks).start()
        router, url, runner = await start_router([a.url])
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json={**STREAM, "n": 2}) as response:
                    body = await response.read()
            error = json.loads(body.split(b"\n\n")[1][6:])["error"]
            assert "cannot be resumed: a request with n=2 is not resumable" in error["message"]
        finally:
            await runner.cleanup()
            await a.stop()

    run(test)


def test_a_stream_with_no_engine_left_to_go_on_ends_with_an_error_saying_so():
    async def test() -> None:
        a = await FakeEngine("a", breaks).start()
        router, url, runner = await start_router([a.url])
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json=STREAM) as response:
                    body = (await response.read()).split(b"\n\n")
            assert json.loads(body[0][6:])["choices"][0]["text"] == "He"
            error = json.loads(body[1][6:])["error"]["message"]
            assert (
                error.endswith("could not be resumed: no other engine is ready")
                and body[2] == b"data: [DONE]"
            )
            assert router.endpoints.all()[0].outstanding == 0
        finally:
            await runner.cleanup()
            await a.stop()

    run(test)


def test_a_stream_its_draining_engine_aborts_goes_on_from_another_engine():
    async def aborts(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)  # the drain timeout passed: the engine ends the choice and the stream
        await out.write(chunk("a", "He", [5, 6]) + chunk("a", "", [], "abort") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def goes_on(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(chunk("b", "llo", [7], "length") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def test() -> None:
        a = await FakeEngine("a", aborts).start()
        b = await FakeEngine("b", goes_on).start()
        router, url, runner = await start_router([a.url, b.url])
        router.policy._next = sorted([a.url, b.url]).index(a.url)  # a first
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json=STREAM) as response:
                    body = await response.read()
            events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
            assert [e["choices"][0]["finish_reason"] for e in events] == [None, "length"]  # no abort shown
            assert body.count(b"[DONE]") == 1 and json.loads(b.requests[-1])["resume_token_ids"] == [5, 6]
            assert router.metrics.resumed.labels("aborted")._value.get() == 1
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()

    run(test)
