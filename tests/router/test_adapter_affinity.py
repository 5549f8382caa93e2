"""LoRA adapter affinity (router/adapters.py): the policy's tiers (active, free slot, spill to the least
loaded engine that serves the adapter), the engines' lora gauge as vLLM writes it, the prefix index keyed by
adapter, and the router reading real HTTP engines' /v1/models and /metrics and sending each adapter's
requests where it is active."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from helpers import free_port
from specfleet.router.adapters import AdapterState, AdapterTable, adapter_candidates, parse_lora_info
from specfleet.router.endpoints import Endpoint, EndpointSet
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router, serve

from .engines import FakeEngine

METRICS = (
    "# TYPE vllm:lora_requests_info gauge\n"
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat"} 1.7e9\n'
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9\n'
)


def test_the_latest_lora_sample_counts() -> None:
    assert parse_lora_info(METRICS) == (frozenset({"sql", "chat"}), 2)
    assert parse_lora_info("vllm:num_requests_running 3\n") == (frozenset(), 0)


def test_active_then_free_slot_then_spill_to_the_least_loaded_server() -> None:
    a, b, c, d = (Endpoint(f"http://{n}", ready=True) for n in "abcd")
    states = {
        "http://a": AdapterState(frozenset({"sql", "chat"}), frozenset({"sql"}), 1),
        "http://b": AdapterState(frozenset({"sql", "chat"}), frozenset(), 1),
        "http://c": AdapterState(frozenset({"sql", "chat"}), frozenset({"chat"}), 1),
        "http://d": AdapterState(),  # serves no adapter: never picked for one
    }
    engines = [a, b, c, d]
    assert adapter_candidates("sql", engines, states) == [a]  # active there
    assert adapter_candidates("chat", engines, states) == [c]
    a.outstanding, b.outstanding, c.outstanding = 6, 1, 2  # a over the cap ceil(1.25 * 10 / 3) = 5
    assert adapter_candidates("sql", engines, states) == [b]  # the free slot, not c (its one slot is taken)
    a.outstanding, b.outstanding = 10, 10  # cap ceil(1.25 * 23 / 3) = 10: a and b over it; c has no slot
    assert adapter_candidates("sql", engines, states) == [c]  # spilled: the least loaded server takes it
    assert adapter_candidates("unknown", engines, states) == engines  # the engine's 404 lists the names


def test_prefix_blocks_are_keyed_by_adapter() -> None:
    router = Router(EndpointSet(), make_policy("prefix"), adapters=AdapterTable())
    assert router.adapters is not None
    router.adapters.states = {"http://a": AdapterState(frozenset({"sql", "chat"}))}
    prompt = "x" * 400

    def route(model: str) -> tuple[int, ...]:
        return router.route_request(json.dumps({"model": model, "prompt": prompt}).encode(), {}).hashes

    assert route("sql") == route("sql")
    assert len({route("base"), route("sql"), route("chat")}) == 3
    assert route("base") == route("other-base-alias")  # not an adapter: the base's chain
    assert not set(route("sql")) & set(route("chat"))


def _engine_serving(adapters: list[str], active: str) -> FakeEngine:
    async def behaviour(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
        if request.path == "/v1/models":
            data = [{"id": "base"}, *({"id": n, "parent": "base"} for n in adapters)]
            return web.json_response({"data": data})
        if request.path == "/metrics":
            return web.Response(
                text=f'vllm:lora_requests_info{{max_lora="1",running_lora_adapters="{active}",'
                f'waiting_lora_adapters=""}} 1.0\n'
            )
        return web.json_response({"engine": engine.name})

    return FakeEngine(active, behaviour)


def test_the_router_reads_the_engines_and_routes_by_adapter() -> None:
    async def test() -> None:
        engines = [await _engine_serving(["sql", "chat"], name).start() for name in ("sql", "chat")]
        endpoints = EndpointSet([e.url for e in engines], ready=True)
        router = Router(endpoints, make_policy("round-robin"), adapters=AdapterTable())
        assert router.adapters is not None
        port = free_port()
        runner = await serve(router, "127.0.0.1", port)
        try:
            for _ in range(100):  # the first poll (router/adapters.py POLL_SECONDS)
                if len(router.adapters.states) == 2:
                    break
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as client:
                for model in ("sql", "chat", "sql", "chat"):
                    body = {"model": model, "prompt": "hello"}
                    async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        assert (await r.json())["engine"] == model
                seen = set()
                for _ in range(4):  # the base model: round-robin over both, as without adapters
                    body = {"model": "base", "prompt": "hello"}
                    async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        seen.add((await r.json())["engine"])
                assert seen == {"sql", "chat"}
        finally:
            await runner.cleanup()
            for engine in engines:
                await engine.stop()

    asyncio.run(asyncio.wait_for(test(), timeout=30))
