"""The router over real sockets: retries only before the first byte, unbuffered SSE, disconnects passed
through, 503 + Retry-After, the scale-from-zero queue, metrics. Engines are tests/router/engines.py."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from helpers import free_port
from specfleet.router.endpoints import EndpointSet
from specfleet.router.front import Front, FrontResponse
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router, prompt_text, serve

from .engines import (
    FakeEngine,
    answer_503,
    break_after_first_byte,
    stream_forever,
    stream_two_events,
)

BODY = {"model": "m", "prompt": "hello " * 40, "max_tokens": 4}


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=30))


async def start_router(
    urls: list[str], policy: str = "round-robin", **options: float
) -> tuple[Router, str, Front]:
    router = Router(EndpointSet(urls, ready=True), make_policy(policy), **options)
    runner = await serve(router, "127.0.0.1", 0)  # the port the kernel chose, read back from the front
    assert runner.port != 0
    return router, f"http://127.0.0.1:{runner.port}", runner


def test_prompt_text_of_completions_and_chat():
    assert prompt_text({"prompt": "abc"}) == ("abc", None)
    assert prompt_text({"prompt": [1, 2, 3]}) == ("", [1, 2, 3])
    chat = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
        ]
    }
    assert prompt_text(chat) == ("system\nS\nuser\nU\n", None)
    assert prompt_text("not a dict") == ("", None)


def test_retry_before_first_byte_on_another_engine():
    async def test() -> None:
        good = await FakeEngine("good").start()
        draining = await FakeEngine("draining", answer_503).start()
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
        router, url, runner = await start_router([dead, draining.url, good.url], "round-robin", max_retries=2)
        try:
            order = sorted([dead, draining.url, good.url])  # round-robin walks the URLs sorted
            async with aiohttp.ClientSession() as client:
                for first in (dead, draining.url, good.url):  # each request starts at a different engine
                    router.policy._next = order.index(first)
                    async with client.post(f"{url}/v1/completions", json=BODY) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["engine"] == "good"
                async with client.get(f"{url}/metrics") as r:
                    text = await r.text()
            assert f'specfleet_router_retries_total{{engine="{dead}"}}' in text
            assert f'specfleet_router_retries_total{{engine="{draining.url}"}}' in text
            assert f'specfleet_router_requests_total{{engine="{good.url}",outcome="ok"}} 3.0' in text
            assert len(good.requests) == 3 and json.loads(good.requests[0]) == BODY  # the body, unchanged
        finally:
            await runner.cleanup()
            await good.stop()
            await draining.stop()

    run(test)


def test_no_retry_after_the_first_byte():
    async def test() -> None:
        broken = await FakeEngine("broken", break_after_first_byte).start()
        other = await FakeEngine("other").start()
        router, url, runner = await start_router(
            [broken.url, other.url], "round-robin", max_retries=2, max_resumes=0
        )  # no resume either (router/resume.py: tests/router/test_resume.py)
        router.policy._next = sorted([broken.url, other.url]).index(broken.url)  # the broken engine first
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as r:
                    assert r.status == 200
                    first = await r.content.readuntil(b"\n\n")
                    assert first == b'data: {"n": 1}\n\n'
                    try:
                        rest = await r.content.read()
                    except aiohttp.ClientPayloadError:
                        rest = b""
                    assert b"cannot be resumed: the router resumes no stream (--max-resumes 0)" in rest
                async with client.get(f"{url}/metrics") as r:
                    text = await r.text()
            assert other.requests == []  # the request was not sent again after bytes reached the client
            assert f'specfleet_router_requests_total{{engine="{broken.url}",outcome="broken"}} 1.0' in text
        finally:
            await runner.cleanup()
            await broken.stop()
            await other.stop()

    run(test)


def test_sse_is_forwarded_unbuffered():
    async def test() -> None:
        engine = await FakeEngine("sse", stream_two_events).start()
        router, url, runner = await start_router([engine.url])
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/chat/completions", json={**BODY, "stream": True}) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    # the engine holds its second event until this first one reached the client
                    first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), timeout=5)
                    assert first == b'data: {"n": 1}\n\n'
                    engine.release.set()
                    assert (await r.content.read()).endswith(b"data: [DONE]\n\n")
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


async def disconnected(router: Router, engine: FakeEngine) -> None:
    """The engine saw its connection dropped, the router's handler unwound and released the engine's
    slot, and the request counts once as `disconnected`."""
    await asyncio.wait_for(engine.disconnected.wait(), timeout=5)
    for _ in range(50):
        if router.endpoints.get(engine.url).outstanding == 0:
            break
        await asyncio.sleep(0.05)
    assert router.endpoints.get(engine.url).outstanding == 0
    assert router.metrics.requests.labels(engine.url, "disconnected")._value.get() == 1


def test_a_client_leaving_while_the_router_writes_is_a_disconnect_not_an_error(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    """A client that leaves between two chunks of its stream: the router's next write finds the
    transport closing before the front's connection_lost cancels the request (under load the write comes
    first); here the client's transport is closed just before the router's second write, so that order is
    certain. The router counts a `disconnected`, drops the engine's connection, and logs no error (it
    logged a traceback per stream that a closed-loop benchmark's window cut). The stream is resumable, so
    its events are written from the engine connection's callback (`write_now`); the task's own writes
    (`write`) are closed alike."""
    write, write_now = FrontResponse.write, FrontResponse.write_now
    writes: dict[int, int] = {}  # id of a response of the router -> chunks written so far

    def leave_before_the_second(self: FrontResponse) -> None:
        writes[id(self)] = writes.get(id(self), 0) + 1
        if writes[id(self)] == 2:
            transport = self._conn.transport
            assert transport is not None
            transport.close()

    async def write_after_the_client_left(self: FrontResponse, data: bytes) -> None:
        leave_before_the_second(self)
        await write(self, data)

    def write_now_after_the_client_left(self: FrontResponse, data: bytes) -> bool:
        leave_before_the_second(self)
        return write_now(self, data)

    monkeypatch.setattr(FrontResponse, "write", write_after_the_client_left)
    monkeypatch.setattr(FrontResponse, "write_now", write_now_after_the_client_left)

    async def test() -> None:
        engine = await FakeEngine("forever", stream_forever).start()
        router, url, runner = await start_router([engine.url])
        try:
            async with aiohttp.ClientSession() as client:
                r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": True})
                await r.content.readuntil(b"\n\n")
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.content.read()
            await disconnected(router, engine)
        finally:
            await runner.cleanup()
            await engine.stop()

    with caplog.at_level(logging.ERROR):
        run(test)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert max(writes.values()) >= 2  # the patched write ran: the client did leave between two writes


def test_client_disconnect_reaches_the_engine():
    async def test() -> None:
        engine = await FakeEngine("forever", stream_forever).start()
        router, url, runner = await start_router([engine.url])
        try:
            async with aiohttp.ClientSession() as client:
                r = await client.post(f"{url}/v1/completions", json={**BODY, "stream": True})
                await r.content.readuntil(b"\n\n")
                r.close()  # the client goes away mid-stream
            await disconnected(router, engine)
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_503_with_retry_after_when_nothing_is_ready_and_the_queue_from_zero():
    async def test() -> None:
        router, url, runner = await start_router([])
        engine = await FakeEngine("late").start()
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json=BODY) as r:
                    assert r.status == 503 and r.headers["Retry-After"] == "1"
                    assert "no engine is ready" in (await r.json())["error"]["message"]
                async with client.get(f"{url}/ready") as r:
                    assert r.status == 503  # discovery has not reported yet
                router.endpoints_changed()
                async with client.get(f"{url}/ready") as r:
                    assert r.status == 200 and (await r.json())["engines"] == 0
                # scale from zero: the request waits in the queue until an engine turns ready
                router.queue_timeout_s = 10.0
                pending = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
                for _ in range(200):  # until it reaches the router's queue: 10 s for a loaded host, not 0.3 s
                    if router._waiting:
                        break
                    await asyncio.sleep(0.05)
                assert router._waiting == 1 and not pending.done()
                router.endpoints_changed(router.endpoints.replace({engine.url: (True, False)}))
                r = await pending
                assert r.status == 200 and (await r.json())["engine"] == "late"
                # draining engines get nothing new
                router.queue_timeout_s = 0.0
                router.endpoints_changed(router.endpoints.replace({engine.url: (True, True)}))
                async with client.post(f"{url}/v1/completions", json=BODY) as r:
                    assert r.status == 503
                assert len(engine.requests) == 1
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_prefix_policy_keeps_a_tenant_on_one_engine_over_http():
    async def test() -> None:
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        router, url, runner = await start_router([a.url, b.url], "prefix")
        try:
            async with aiohttp.ClientSession() as client:
                seen: dict[int, set[str]] = {}
                for turn in range(4):
                    for tenant in range(4):
                        prompt = f"tenant {tenant} system prompt. " * 20 + "question " * turn
                        async with client.post(f"{url}/v1/completions", json={"prompt": prompt}) as r:
                            seen.setdefault(tenant, set()).add((await r.json())["engine"])
                async with client.get(f"{url}/metrics") as r:
                    text = await r.text()
            assert all(len(engines) == 1 for engines in seen.values()), seen
            assert 'specfleet_router_decisions_total{policy="prefix",reason="prefix"} 12.0' in text
            assert "specfleet_router_prefix_match_tokens_bucket" in text
            # 16 prompts of 7 full 64-character blocks, all in the tenant's 480-character prefix: each
            # tenant's first goes by the ring (no match), its next three match all 7 blocks
            assert 'specfleet_router_prefix_blocks_total{kind="prompt"} 112.0' in text
            assert 'specfleet_router_prefix_blocks_total{kind="matched"} 84.0' in text
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()

    run(test)
