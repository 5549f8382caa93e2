"""The router passes a client's `priority` (vLLM's request field, honoured by engines started with
`--scheduling-policy priority`) through unchanged: to the engine that answers, and under prefill/decode
disaggregation to both the prefill and the decode engine. Engines are tests/router/engines.py's stand-ins,
over real sockets."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from helpers import free_port
from specfleet.router.endpoints import EndpointSet
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router, serve

from .engines import FakeEngine

BODY = {"model": "m", "prompt": "hello " * 20, "max_tokens": 4, "priority": -3}
HELD = {"do_remote_prefill": True, "transfer_id": "t-1", "first_token_id": 7}


async def answer_held(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    """A prefill engine's answer: the request's first token is computed and its KV held."""
    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": HELD})


async def _post(urls: list[str], prefill: str | None = None) -> None:
    endpoints = EndpointSet(urls, ready=True)
    if prefill is not None:
        endpoints.set_state(prefill, ready=True, role="prefill")
    router = Router(endpoints, make_policy("round-robin"))
    port = free_port()
    runner = await serve(router, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY) as r:
                assert r.status == 200, await r.text()
    finally:
        await runner.cleanup()


def test_priority_reaches_the_engine_unchanged() -> None:
    async def test() -> None:
        engine = await FakeEngine("e").start()
        try:
            await _post([engine.url])
            assert json.loads(engine.requests[0])["priority"] == -3
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(test(), timeout=30))


def test_priority_reaches_both_engines_of_a_prefill_decode_pair() -> None:
    async def test() -> None:
        prefill = await FakeEngine("prefill", answer_held).start()
        decode = await FakeEngine("decode").start()
        try:
            await _post([prefill.url, decode.url], prefill=prefill.url)
            first, second = json.loads(prefill.requests[0]), json.loads(decode.requests[0])
            assert first["kv_transfer_params"] == {"do_remote_decode": True}  # it did run as a P/D pair
            assert second["kv_transfer_params"] == HELD
            assert first["priority"] == second["priority"] == -3
        finally:
            await prefill.stop()
            await decode.stop()

    asyncio.run(asyncio.wait_for(test(), timeout=30))
