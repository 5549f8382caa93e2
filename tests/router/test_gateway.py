"""`specfleet router --gateway` over real sockets: two real engines (the tiny llama, each serving under a name
of its own) behind one gateway, driven by the official openai client. Routing by `model` (served name and
aliases), `/v1/models` as the union, an unknown model's 404 listing the known ones, the canary split by
weight (exact, by smooth weighted round robin), sticky sessions, and a weight change followed at once; the
`/v1` answers written by the router's raw front, the rest by the application behind it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from specfleet.router.endpoints import EndpointSet
from specfleet.router.gateway import SERVICE_HEADER, Gateway, serve_gateway
from specfleet.router.policies import service_policy
from specfleet.router.prefix import BlockHasher
from specfleet.router.proxy import Router

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(240)


def service_router(url: str) -> Router:
    """A service's router as `specfleet router` builds it from the spec's defaults, over one engine."""
    return Router(
        EndpointSet([url], ready=True),
        service_policy("prefix", True, 125),
        BlockHasher(16),
        "x-session-id",
    )


def run_gateway(gateway: Gateway, test: Callable[[openai.AsyncOpenAI], Awaitable[None]]) -> None:
    async def main() -> None:
        runner = await serve_gateway(gateway, "127.0.0.1", 0)
        port = runner.port  # the kernel's pick: no other socket can take it between a pick and a bind
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        try:
            await test(client)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), timeout=180))


async def complete(client: openai.AsyncOpenAI, model: str, **extra: object) -> tuple[str, str]:
    """One completion through the gateway: (the service header, the engine's served name)."""
    raw = await client.completions.with_raw_response.create(
        model=model, prompt="The gateway routes", max_tokens=2, **extra
    )
    return raw.headers[SERVICE_HEADER], raw.parse().model


def test_routes_by_model_and_alias_and_lists_the_union(engines: dict[str, str]) -> None:
    gateway = Gateway()
    gateway.upsert("team-a/alpha", ["alpha", "chat"], 100, service_router(engines["engine-a"]))
    gateway.upsert("team-b/beta", ["beta"], 100, service_router(engines["engine-b"]))
    gateway.synced = True

    async def test(client: openai.AsyncOpenAI) -> None:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["alpha", "beta", "chat"]
        assert await complete(client, "alpha") == ("team-a/alpha", "engine-a")
        assert await complete(client, "chat") == ("team-a/alpha", "engine-a")  # an alias
        assert await complete(client, "beta") == ("team-b/beta", "engine-b")
        chat = await client.chat.completions.with_raw_response.create(
            model="beta", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.headers[SERVICE_HEADER] == "team-b/beta" and chat.parse().model == "engine-b"
        stream = await client.chat.completions.create(
            model="chat", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        chunks = [c async for c in stream]
        assert chunks and {c.model for c in chunks} == {"engine-a"}

        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="gamma", prompt="x", max_tokens=1)
        error = missing.value.body
        assert isinstance(error, dict)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "`gamma`" in error["message"] and "alpha, beta, chat" in error["message"]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gamma")
        assert (await client.models.retrieve("chat")).id == "chat"

        # one scrape for every service's router, each series labelled with its service
        async with aiohttp.ClientSession() as http:
            async with http.get(str(client.base_url).replace("/v1/", "/metrics")) as response:
                text = await response.text()
        served = {
            line.split('service="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("specfleet_router_requests_total{") and 'outcome="ok"' in line
        }
        assert served == {"team-a/alpha", "team-b/beta"}

    run_gateway(gateway, test)


def test_canary_splits_by_weight_sticks_by_session_and_follows_a_weight_change(
    engines: dict[str, str],
) -> None:
    gateway = Gateway()
    gateway.upsert("prod/llm-v1", ["llm-v1", "llm"], 300, service_router(engines["engine-a"]))
    canary = service_router(engines["engine-b"])
    gateway.upsert("prod/llm-v2", ["llm-v2", "llm"], 100, canary)
    gateway.synced = True

    async def test(client: openai.AsyncOpenAI) -> None:
        # 3:1 without a session: smooth weighted round robin gives exactly 6 and 2 in any 8 requests
        answered = [await complete(client, "llm") for _ in range(8)]
        assert Counter(service for service, _ in answered) == {"prod/llm-v1": 6, "prod/llm-v2": 2}
        assert {(s, m) for s, m in answered} == {("prod/llm-v1", "engine-a"), ("prod/llm-v2", "engine-b")}
        # a service's own name reaches it alone, whatever the weights
        assert (await complete(client, "llm-v2"))[0] == "prod/llm-v2"

        # a session id (header, else the body's `user`) keeps its service
        by_session = {}
        for i in range(24):
            first = (await complete(client, "llm", extra_headers={"x-session-id": f"s{i}"}))[0]
            again = (await complete(client, "llm", extra_headers={"x-session-id": f"s{i}"}))[0]
            assert first == again, f"session s{i} moved from {first} to {again}"
            by_session[f"s{i}"] = first
        assert set(by_session.values()) == {"prod/llm-v1", "prod/llm-v2"}
        users = {(await complete(client, "llm", user="u7"))[0] for _ in range(4)}
        assert len(users) == 1

        # the canary's weight goes to 0: nothing new reaches it, sessions included
        gateway.upsert("prod/llm-v2", ["llm-v2", "llm"], 0, canary)
        after = [await complete(client, "llm") for _ in range(4)]
        after += [
            await complete(client, "llm", extra_headers={"x-session-id": s})
            for s, where in by_session.items()
            if where == "prod/llm-v2"
        ]
        assert {service for service, _ in after} == {"prod/llm-v1"}
        # and back to equal weights: 1:1
        gateway.upsert("prod/llm-v2", ["llm-v2", "llm"], 300, canary)
        even = Counter([(await complete(client, "llm"))[0] for _ in range(4)])
        assert even == {"prod/llm-v1": 2, "prod/llm-v2": 2}

    run_gateway(gateway, test)


def test_a_canary_without_ready_engines_does_not_take_its_share(engines: dict[str, str]) -> None:
    gateway = Gateway()
    gateway.upsert("prod/llm-v1", ["llm"], 100, service_router(engines["engine-a"]))
    down = Router(EndpointSet(), service_policy("prefix", True, 125), BlockHasher(16))
    gateway.upsert("prod/llm-v2", ["llm"], 100, down)
    gateway.upsert("prod/off", ["off"], 0, service_router(engines["engine-b"]))
    gateway.synced = True

    async def test(client: openai.AsyncOpenAI) -> None:
        assert {(await complete(client, "llm"))[0] for _ in range(4)} == {"prod/llm-v1"}
        with pytest.raises(openai.APIStatusError) as off:
            await client.completions.create(model="off", prompt="x", max_tokens=1)
        assert off.value.status_code == 503 and "routing.weight 0" in str(off.value.body)
        with pytest.raises(openai.BadRequestError) as no_model:
            await client.post("/completions", body={"prompt": "x"}, cast_to=object)
        assert isinstance(no_model.value.body, dict) and no_model.value.body["param"] == "model"

    run_gateway(gateway, test)


def test_v1_is_answered_by_the_raw_front_and_the_rest_by_the_application_behind_it(
    engines: dict[str, str],
) -> None:
    """The gateway serves `/v1/...` on the router's raw front (router/front.py), as a service's router does:
    its answers carry the service header and no aiohttp `Server` header; /health, /ready and /metrics are
    relayed to the gateway's aiohttp application, whose answers do carry it. A name with a slash (an
    `org/model` alias) is one model, and once the gateway stops, every answer closes its connection."""
    gateway = Gateway()
    gateway.upsert("team-a/alpha", ["alpha", "org/alpha"], 100, service_router(engines["engine-a"]))
    gateway.synced = True

    async def test(client: openai.AsyncOpenAI) -> None:
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{base}/v1/completions", json={"model": "org/alpha", "prompt": "x", "max_tokens": 1}
            ) as answer:
                assert answer.status == 200 and answer.headers[SERVICE_HEADER] == "team-a/alpha"
                assert "aiohttp" not in answer.headers.get("Server", "")
                assert (await answer.json())["model"] == "engine-a"
            async with http.get(f"{base}/v1/models/org/alpha") as card:
                assert card.status == 200 and (await card.json())["id"] == "org/alpha"
                assert "aiohttp" not in card.headers.get("Server", "")
            async with http.get(f"{base}/ready") as ready:
                assert ready.status == 200 and "aiohttp" in ready.headers["Server"]
            gateway.stopping = True
            async with http.get(f"{base}/v1/models") as listed:
                assert listed.status == 200 and listed.headers["Connection"] == "close"
            async with http.get(f"{base}/ready") as stopping:
                assert stopping.status == 503

    run_gateway(gateway, test)
