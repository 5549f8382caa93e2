"""The router's SIGTERM drain in process (router/shutdown.py): /ready fails first, new requests are served
through the shutdown delay and refused after it, a stream in flight finishes, and the drain ends when it
does; the drain timeout cuts what is still running. The whole process under a rolling update:
test_router_rolling_update.py."""

from __future__ import annotations

import asyncio

import aiohttp

from .engines import FakeEngine, stream_forever, stream_two_events
from .test_proxy import BODY, run, start_router


def test_drain_serves_through_the_delay_then_refuses_and_finishes_the_stream() -> None:
    from specfleet.router.shutdown import drain

    async def test() -> None:
        engine = await FakeEngine("e", stream_two_events).start()
        router, url, runner = await start_router([engine.url])
        forced = asyncio.Event()
        try:
            async with aiohttp.ClientSession() as http:
                stream = await http.post(f"{url}/v1/completions", json={**BODY, "stream": True})
                assert stream.status == 200 and b'"n": 1' in await stream.content.readline()
                draining = asyncio.ensure_future(drain(router, 0.5, 10.0, forced))
                await asyncio.sleep(0.05)
                ready = await http.get(f"{url}/ready")
                assert ready.status == 503  # the Service drops the pod first
                engine.behaviour = lambda request, e: _ok(request)
                during = await http.post(f"{url}/v1/completions", json=BODY)
                assert during.status == 200  # routed before the removal: still served in the delay
                assert during.headers.get("Connection", "").lower() == "close"  # a keep-alive client moves on
                await asyncio.sleep(0.6)
                after = await http.post(f"{url}/v1/completions", json=BODY)
                assert after.status == 503 and after.headers["Retry-After"] == "5"
                assert not draining.done()  # the stream is still in flight
                engine.release.set()
                rest = await stream.read()
                assert rest.endswith(b"data: [DONE]\n\n")
                await asyncio.wait_for(draining, 2.0)
                assert router.in_flight == 0
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


def test_the_drain_timeout_cuts_what_is_left() -> None:
    from specfleet.router.shutdown import drain

    async def test() -> None:
        engine = await FakeEngine("e", stream_forever).start()
        router, url, runner = await start_router([engine.url])
        try:
            async with aiohttp.ClientSession() as http:
                stream = await http.post(f"{url}/v1/completions", json={**BODY, "stream": True})
                await stream.content.readline()
                loop = asyncio.get_running_loop()
                start = loop.time()
                await drain(router, 0.0, 0.3, asyncio.Event())
                assert 0.3 <= loop.time() - start < 1.5 and router.in_flight == 1
                stream.close()
        finally:
            await runner.cleanup()
            await engine.stop()

    run(test)


async def _ok(request: object) -> aiohttp.web.StreamResponse:
    return aiohttp.web.json_response({"ok": True})
