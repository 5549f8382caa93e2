"""The gateway's tenants over real sockets, driven by the official openai client: 401 without a key or with a
wrong one, 403 outside the tenant's models, 429 with `Retry-After` and OpenAI's `x-ratelimit-*` headers,
the tenant's priority in the body the engine gets, usage asked of a stream and hidden from a client that
did not ask, and tokens charged by the engine's usage. The engines are stand-ins (tests/router/engines.py)
that answer as the engine does, usage included: the test is about the gateway alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from specfleet.router.quota import LocalLimiter
from specfleet.router.tenant_gate import TenantGate
from specfleet.router.tenants import Tenant, TenantSpec, TenantTable

from .engines import FakeEngine, gateway_over

openai = pytest.importorskip("openai")

KEYS = {"team-a": "sk-team-a-0123456789abcdef", "batch": "sk-batch-0123456789abcdef"}
PROMPT_TOKENS = 3  # what the stand-in engine reports for any prompt


async def answer_like_an_engine(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    """`/v1/models`, and completions as the engine writes them: `max_tokens` tokens, usage in the answer
    (in a last chunk of a stream, and `"usage":null` in the others, only with include_usage)."""
    if request.path == "/v1/models":
        return web.json_response({"object": "list", "data": [{"id": engine.name, "object": "model"}]})
    body = json.loads(await request.read())
    n = body.get("max_tokens", 1)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": engine.name}
    if not body.get("stream"):
        choice = {"index": 0, "text": "x" * n, "finish_reason": "length", "logprobs": None}
        return web.json_response({**base, "choices": [choice], "usage": usage})
    include = (body.get("stream_options") or {}).get("include_usage") is True
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for _ in range(n):
        chunk: dict[str, Any] = {**base, "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        if include:
            chunk["usage"] = None
        await out.write(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
    if include:
        await out.write(
            f"data: {json.dumps({**base, 'choices': [], 'usage': usage}, separators=(',', ':'))}\n\n".encode()
        )
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def frozen() -> float:
    """The buckets' clock, stopped: nothing refills during a test, so every count is exact."""
    return 1000.0


def tenants(**limits: dict[str, Any]) -> TenantTable:
    return TenantTable(
        [
            Tenant.of(TenantSpec.model_validate({"name": n, "keys": [KEYS[n]], **spec}))
            for n, spec in limits.items()
        ]
    )


def run_gate(gate: TenantGate, test: Callable[[str, FakeEngine], Awaitable[None]]) -> None:
    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        async with gateway_over(engine, [("team-a/alpha", 100), ("team-b/beta", 100)], gate) as url:
            await test(url, engine)

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def client(url: str, tenant: str | None) -> Any:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=KEYS.get(tenant or "", "sk-wrong-0123456789abcdef"), max_retries=0
    )


def sent(engine: FakeEngine) -> list[dict[str, Any]]:
    """The bodies the engine got for completions (the gateway's `/v1/models` lookups apart)."""
    return [json.loads(b) for b in engine.requests if b]


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        return await response.text()


def test_keys_models_and_priority() -> None:
    gate = TenantGate(
        tenants(
            **{"team-a": {"models": ["alpha"], "priority": "interactive"}, "batch": {"priority": "batch"}}
        )
    )

    async def test(url: str, engine: FakeEngine) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "x"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            async with http.get(f"{url}/v1/models") as r:
                assert r.status == 401  # the model list too
            async with http.get(f"{url}/health") as r:
                assert r.status == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError) as wrong:
            await client(url, None).completions.create(model="alpha", prompt="x", max_tokens=1)
        assert "unknown API key" in wrong.value.message
        assert not sent(engine)

        a = client(url, "team-a")
        assert [m.id for m in (await a.models.list()).data] == ["alpha"]  # only its models
        assert [m.id for m in (await client(url, "batch").models.list()).data] == ["alpha", "beta"]
        with pytest.raises(openai.NotFoundError):
            await a.models.retrieve("beta")
        with pytest.raises(openai.PermissionDeniedError) as other:
            await a.completions.create(model="beta", prompt="x", max_tokens=1)
        assert (
            other.value.body["code"] == "model_not_allowed"
            and "may call alpha" in other.value.body["message"]
        )
        answer = await a.completions.create(
            model="alpha", prompt="x", max_tokens=2, extra_body={"priority": 99}
        )
        assert answer.usage is not None and answer.usage.total_tokens == PROMPT_TOKENS + 2
        await client(url, "batch").completions.create(model="beta", prompt="x", max_tokens=1)
        assert [b["priority"] for b in sent(engine)] == [-10, 10]  # the class's, not the client's 99
        auth = {"Authorization": f"Bearer {KEYS['team-a']}"}
        async with aiohttp.ClientSession() as http:  # a route without `priority` gets none
            async with http.post(
                f"{url}/v1/tokenize", json={"model": "alpha", "prompt": "x"}, headers=auth
            ) as r:
                assert r.status == 200
        assert sent(engine)[-1] == {"model": "engine-a", "prompt": "x"}

        text = await metrics(url)
        assert 'specfleet_gateway_tenant_requests_total{result="unauthorized",tenant="unknown"} 3.0' in text
        assert 'specfleet_gateway_tenant_requests_total{result="forbidden",tenant="team-a"} 1.0' in text
        assert 'specfleet_gateway_tenant_requests_total{result="ok",tenant="team-a"} 2.0' in text
        # the completion's usage and the tokenize answer's (the stand-in reports usage for any body: 1 token)
        charged = (PROMPT_TOKENS + 2) + (PROMPT_TOKENS + 1)
        assert f'specfleet_gateway_tenant_tokens_total{{result="ok",tenant="team-a"}} {charged}.0' in text

    run_gate(gate, test)


def test_a_stream_is_charged_its_usage_which_the_client_sees_only_when_it_asked() -> None:
    gate = TenantGate(tenants(**{"team-a": {"tpm": 1000}}), LocalLimiter(clock=frozen))

    async def test(url: str, engine: FakeEngine) -> None:
        a = client(url, "team-a")
        chunks = [
            c
            async for c in await a.completions.create(model="alpha", prompt="abcd", max_tokens=4, stream=True)
        ]
        assert len(chunks) == 4 and all(c.usage is None for c in chunks)
        assert sent(engine)[-1]["stream_options"] == {"include_usage": True}  # asked for the gateway
        async with aiohttp.ClientSession() as http:  # the raw stream: no usage anywhere
            body = {"model": "alpha", "prompt": "abcd", "max_tokens": 2, "stream": True}
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['team-a']}"}
            ) as r:
                raw = await r.read()
                remaining = int(r.headers["x-ratelimit-remaining-tokens"])
        assert b"usage" not in raw and raw.count(b"data: ") == 3
        # charged at admission: 1 (4 bytes) + 2; the first stream's estimate, 1 + 4, was settled to its usage
        assert remaining == 1000 - (PROMPT_TOKENS + 4) - (1 + 2)

        asked = await a.completions.create(
            model="alpha", prompt="abcd", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in asked]
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == PROMPT_TOKENS + 3
        text = await metrics(url)
        total = (PROMPT_TOKENS + 4) + (PROMPT_TOKENS + 2) + (PROMPT_TOKENS + 3)
        assert f'specfleet_gateway_tenant_tokens_total{{result="ok",tenant="team-a"}} {total}.0' in text

    run_gate(gate, test)


def test_over_quota_is_a_429_with_openai_headers() -> None:
    gate = TenantGate(tenants(**{"team-a": {"rpm": 2, "tpm": 100}}), LocalLimiter(clock=frozen))

    async def test(url: str, engine: FakeEngine) -> None:
        a = client(url, "team-a")
        ok = await a.completions.with_raw_response.create(model="alpha", prompt="abcd", max_tokens=1)
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
        assert ok.headers["x-ratelimit-remaining-requests"] == "1"
        assert ok.headers["x-ratelimit-limit-tokens"] == "100"
        assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
        with pytest.raises(openai.RateLimitError) as large:
            await a.completions.create(model="alpha", prompt="abcd", max_tokens=200)
        assert (
            large.value.body["code"] == "tokens_exceed_limit"
            and "Retry-After" not in large.value.response.headers
        )
        await a.completions.create(model="alpha", prompt="abcd", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as over:
            await a.completions.create(model="alpha", prompt="abcd", max_tokens=1)
        headers = over.value.response.headers
        assert over.value.body["code"] == "rate_limit_exceeded"
        assert headers["x-ratelimit-remaining-requests"] == "0" and int(headers["Retry-After"]) == 30
        assert len(sent(engine)) == 2
        text = await metrics(url)
        assert 'specfleet_gateway_tenant_requests_total{result="rate_limited",tenant="team-a"} 1.0' in text
        assert 'specfleet_gateway_tenant_requests_total{result="too_large",tenant="team-a"} 1.0' in text

    run_gate(gate, test)


async def answer_like_an_fcfs_engine(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    """An engine under `--scheduling-policy fcfs`: its `/v1/models` says so, and a nonzero `priority` is a
    400 (engine/llm_engine.py's check)."""
    if request.path == "/v1/models":
        card = {"id": engine.name, "object": "model", "scheduling_policy": "fcfs"}
        return web.json_response({"object": "list", "data": [card]})
    if json.loads(await request.read()).get("priority", 0):
        return web.json_response({"error": {"message": "priority under fcfs"}}, status=400)
    return await answer_like_an_engine(request, engine)


def test_a_service_that_schedules_fcfs_gets_no_priority() -> None:
    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_fcfs_engine).start()
        gate = TenantGate(tenants(batch={"priority": "batch"}))
        async with gateway_over(engine, [("team-a/alpha", 100)], gate) as url:
            batch = client(url, "batch")
            answer = await batch.completions.create(
                model="alpha", prompt="x", max_tokens=1, extra_body={"priority": 5}
            )
            assert answer.usage is not None  # a 200, where the tenant's priority 10 would be a 400
            assert [b.get("priority") for b in sent(engine)] == [None]  # neither the class's nor the client's

    asyncio.run(asyncio.wait_for(main(), timeout=60))
