"""Ways around the gateway's tenant gate, each closed, over real sockets with the official openai client: a
field the engine would coerce (`"stream": 1`, `"n": "8"`) is a 400 naming it, not a stream the gate never
asked usage of; a batch of prompts is estimated for every prompt; a stream the client cut before its usage
is charged the text it got; the tenant's key never reaches an engine; errors name only the models the
tenant may see; a request that can never fit tells the client not to retry; content parts whose `text` is
no string are the engine's to judge, not a 500; the Redis URL's password stays out of the logs; a service
whose engines are all down is a 503 with `Retry-After` while the other serves (checked, unchanged). The
engines are stand-ins (tests/router/engines.py: real aiohttp servers) that answer as the engine does; what
they do not model is generation itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers import free_port
from specfleet.router.endpoints import EndpointSet
from specfleet.router.gateway import Gateway, serve_gateway
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router
from specfleet.router.quota import LocalLimiter
from specfleet.router.redis_limits import RedisLimiter, redacted
from specfleet.router.tenant_gate import TenantGate, estimate_tokens

from .engines import FakeEngine, gateway_over
from .test_tenant_gate import KEYS, answer_like_an_engine, client, frozen, metrics, run_gate, sent, tenants

openai = pytest.importorskip("openai")

AUTH = {"Authorization": f"Bearer {KEYS['team-a']}"}
CHUNKS = 8  # the chat stream's chunks of "abcd" (4 bytes: one token each, as the gate estimates text)


def charged(text: str, tenant: str) -> float:
    """The tokens the gateway's metrics say `tenant` was charged for its admitted requests."""
    prefix = f'specfleet_gateway_tenant_tokens_total{{result="ok",tenant="{tenant}"}} '
    return sum(float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix))


def test_a_field_the_engine_would_coerce_is_a_400_naming_it() -> None:
    """The engine's schema reads `"stream": 1` as a stream and `"n": "8"` as 8; the gate reading neither would
    charge such a request only its estimate (no usage asked of the stream, one choice counted)."""
    gate = TenantGate(tenants(**{"team-a": {"tpm": 1000}}), LocalLimiter(clock=frozen))

    async def test(url: str, engine: FakeEngine) -> None:
        a = client(url, "team-a")
        for field, value in [
            ("stream", 1),
            ("stream", "true"),
            ("n", "8"),
            ("max_tokens", 2.0),
            ("max_completion_tokens", True),
            ("stream_options", "yes"),
        ]:
            with pytest.raises(openai.BadRequestError) as wrong:
                await a.completions.create(model="alpha", prompt="abcd", extra_body={field: value})
            assert wrong.value.body["param"] == field and wrong.value.body["code"] == "invalid_type"
            assert f"`{field}` must be" in wrong.value.body["message"]
        with pytest.raises(openai.BadRequestError) as nested:
            await a.completions.create(
                model="alpha", prompt="abcd", stream=True, stream_options={"include_usage": "yes"}
            )
        assert nested.value.body["param"] == "stream_options.include_usage"
        assert not sent(engine)  # none of them reached an engine
        # null is the engine's to judge, and well-typed fields pass
        ok = await a.completions.create(model="alpha", prompt="abcd", max_tokens=2, extra_body={"n": None})
        assert ok.usage is not None
        assert 'specfleet_gateway_tenant_requests_total{result="invalid",tenant="team-a"} 7.0' in (
            await metrics(url)
        )

    run_gate(gate, test)


def test_a_batch_of_prompts_is_estimated_for_each_prompt() -> None:
    assert estimate_tokens({"prompt": ["abcd", "abcd", "abcd"], "max_tokens": 5, "n": 2}, None) == 3 + 30
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 4}, None) == 3 + 8
    assert estimate_tokens({"input": [1, 2, 3]}, None) == 3  # embeddings of token ids
    # max_completion_tokens null: the engine reads max_tokens, so does the estimate
    assert estimate_tokens({"prompt": "abcd", "max_completion_tokens": None, "max_tokens": 7}, None) == 8
    gate = TenantGate(tenants(**{"team-a": {"tpm": 100}}), LocalLimiter(clock=frozen))

    async def test(url: str, engine: FakeEngine) -> None:
        with pytest.raises(openai.RateLimitError) as large:  # 4 prompts x 30 tokens: more than 100
            await client(url, "team-a").completions.create(model="alpha", prompt=["abcd"] * 4, max_tokens=30)
        assert large.value.body["code"] == "tokens_exceed_limit" and not sent(engine)

    run_gate(gate, test)


def test_a_request_that_can_never_fit_tells_the_client_not_to_retry() -> None:
    """The openai client retries every 429 unless told `x-should-retry: false`; one over the whole limit
    would only be refused again (and counted again)."""
    gate = TenantGate(tenants(**{"team-a": {"tpm": 10}}), LocalLimiter(clock=frozen))

    async def test(url: str, engine: FakeEngine) -> None:
        retrying = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["team-a"], max_retries=2)
        with pytest.raises(openai.RateLimitError) as large:
            await retrying.completions.create(model="alpha", prompt="abcd", max_tokens=50)
        assert large.value.response.headers["x-should-retry"] == "false"
        assert large.value.body["param"] == "max_tokens"  # the prompt fits: max_tokens is what to shrink
        assert 'specfleet_gateway_tenant_requests_total{result="too_large",tenant="team-a"} 1.0' in (
            await metrics(url)
        )
        # a prompt too long by itself: no max_tokens can make it fit, and the field named is the prompt's
        with pytest.raises(openai.RateLimitError) as long_prompt:
            await retrying.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "word " * 40}], max_completion_tokens=1
            )
        assert long_prompt.value.body["param"] == "messages"
        assert "the prompt alone is" in long_prompt.value.body["message"]
        with pytest.raises(openai.RateLimitError) as completion:
            await retrying.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=50
            )
        assert completion.value.body["param"] == "max_completion_tokens"
        assert not sent(engine)

    run_gate(gate, test)


async def stream_then_stall(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    """A chat stream of CHUNKS chunks of "abcd" that then stalls before its end and usage, as a long answer
    without `max_tokens` would be still going when the client leaves."""
    if request.path == "/v1/models":
        return await answer_like_an_engine(request, engine)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for _ in range(CHUNKS):
        chunk: dict[str, Any] = {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": engine.name,
            "usage": None,
        }
        chunk["choices"] = [{"index": 0, "delta": {"content": "abcd"}, "finish_reason": None}]
        await out.write(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
    await engine.release.wait()
    return out


def test_a_stream_cut_before_its_usage_is_charged_the_text_it_got() -> None:
    gate = TenantGate(tenants(**{"team-a": {"tpm": 1000}}), LocalLimiter(clock=frozen))

    async def test(url: str, engine: FakeEngine) -> None:
        engine.behaviour = stream_then_stall
        stream = await client(url, "team-a").chat.completions.create(
            model="alpha", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        got = []
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content)
            if len(got) == CHUNKS:
                break
        await stream.close()  # the client leaves; the engine never sent its usage
        assert "".join(got) == "abcd" * CHUNKS
        prompt = 2  # "user\nhi\n": 8 bytes, 2 tokens by the estimate
        for _ in range(100):
            if charged(await metrics(url), "team-a"):
                break
            await asyncio.sleep(0.05)
        assert charged(await metrics(url), "team-a") == prompt + CHUNKS  # not the estimate's 2 alone

    run_gate(gate, test)


def test_the_tenant_s_key_never_reaches_an_engine() -> None:
    gate = TenantGate(tenants(**{"team-a": {}}))
    kept: list[dict[str, str]] = []  # the headers of every request the engine got

    async def answer_and_keep_headers(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
        kept.append(dict(request.headers))
        return await answer_like_an_engine(request, engine)

    async def test(url: str, engine: FakeEngine) -> None:
        engine.behaviour = answer_and_keep_headers
        a = client(url, "team-a")
        await a.completions.create(model="alpha", prompt="x", max_tokens=1)
        chunks = [
            c async for c in await a.completions.create(model="alpha", prompt="x", max_tokens=2, stream=True)
        ]
        assert chunks
        assert len([h for h in kept if h.get("Content-Type") == "application/json"]) == 2  # both completions
        assert all("Authorization" not in h and KEYS["team-a"] not in json.dumps(h) for h in kept)

    run_gate(gate, test)


def test_errors_name_only_the_models_the_tenant_may_call() -> None:
    """/v1/models lists only the tenant's models; a 404 or a 400 listing every name would tell it the rest."""
    gate = TenantGate(tenants(**{"team-a": {"models": ["alpha"]}}))

    async def test(url: str, engine: FakeEngine) -> None:
        a = client(url, "team-a")
        with pytest.raises(openai.NotFoundError) as missing:
            await a.completions.create(model="gamma", prompt="x", max_tokens=1)
        assert "Known models: alpha." in missing.value.body["message"]
        with pytest.raises(openai.NotFoundError) as hidden:
            await a.models.retrieve("beta")
        assert hidden.value.body["message"].endswith("Known models: alpha.")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", data=b"{not json", headers=AUTH) as r:
                error = (await r.json())["error"]
        assert r.status == 400 and error["param"] == "model"
        assert "is not a JSON object" in error["message"] and "beta" not in error["message"]
        async with aiohttp.ClientSession() as http, http.get(f"{url}/ready") as r:  # open: no key asked
            assert r.status == 200 and await r.json() == {"status": "ready"}  # and no model names

    run_gate(gate, test)


def test_content_parts_whose_text_is_no_string_are_not_a_500() -> None:
    """The gate's estimate and the router's prompt hash both read the chat's text parts; `"text": 5` broke
    both with a TypeError (a 500). It goes to the engine, which refuses it by name (a 400)."""
    gate = TenantGate(tenants(**{"team-a": {}}))

    async def test(url: str, engine: FakeEngine) -> None:
        body: dict[str, Any] = {
            "model": "alpha",
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": "hi"}]}
            ],
        }
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
                assert r.status == 200, await r.text()  # the stand-in engine answers any body
        assert sent(engine)[-1]["messages"] == body["messages"]

    run_gate(gate, test)


def test_the_redis_password_stays_out_of_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The chart takes `--redis-url` from a Secret because it may hold a password; the limiter's log line
    when Redis is unreachable (a real refused connection here) names the URL with the password masked."""
    assert redacted("redis://:s3cret-pw@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://app:s3cret-pw@redis:6379") == "rediss://app:***@redis:6379"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"
    (team,) = tenants(**{"team-a": {"rpm": 5}}).tenants.values()

    async def main() -> None:
        limiter = RedisLimiter(f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0")  # nothing listens there
        try:
            verdict, _ = await limiter.admit(team, 1)
        finally:
            await limiter.close()
        assert verdict.allowed  # by the local buckets it fell back to

    with caplog.at_level(logging.WARNING, logger="specfleet.router.tenants"):
        asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert "event=redis_unreachable url=redis://:***@127.0.0.1:" in caplog.text
    assert "s3cret-pw" not in caplog.text


def test_a_missing_or_wrong_key_is_a_401_naming_the_bearer_scheme() -> None:
    gate = TenantGate(tenants(**{"team-a": {}}))

    async def test(url: str, engine: FakeEngine) -> None:
        with pytest.raises(openai.AuthenticationError) as wrong:
            await client(url, None).completions.create(model="alpha", prompt="x", max_tokens=1)
        assert wrong.value.response.headers["WWW-Authenticate"] == "Bearer"
        assert wrong.value.body["code"] == "invalid_api_key" and not sent(engine)

    run_gate(gate, test)


def test_a_service_whose_engines_are_all_down_is_a_503_and_the_other_serves() -> None:
    """Checked, not changed: the down service's 503 carries `Retry-After` (the openai client waits that long
    before its retries), its tokens are given back, and the other service answers as before."""
    gate = TenantGate(tenants(**{"team-a": {"tpm": 1000}}), LocalLimiter(clock=frozen))

    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        gateway = Gateway(tenants=gate)
        down = Router(
            EndpointSet([f"http://127.0.0.1:{free_port()}"], ready=False), make_policy("round-robin")
        )
        down.synced = True  # discovery has reported: no engine is ready
        gateway.upsert(
            "ns/alpha",
            ["alpha"],
            100,
            Router(EndpointSet([engine.url], ready=True), make_policy("round-robin")),
        )
        gateway.upsert("ns/beta", ["beta"], 100, down)
        gateway.synced = True
        port = free_port()
        runner = await serve_gateway(gateway, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        try:
            a = client(url, "team-a")
            with pytest.raises(openai.InternalServerError) as unavailable:
                await a.completions.create(model="beta", prompt="abcd", max_tokens=5)
            assert unavailable.value.status_code == 503
            assert int(unavailable.value.response.headers["Retry-After"]) >= 1
            assert unavailable.value.body["type"] == "service_unavailable"
            ok = await a.completions.with_raw_response.create(model="alpha", prompt="abcd", max_tokens=1)
            assert ok.headers["x-specfleet-service"] == "ns/alpha"
            # the 503's estimate (1 + 5) came back before this one's (1 + 1) was charged
            assert ok.headers["x-ratelimit-remaining-tokens"] == str(1000 - 2)
        finally:
            await runner.cleanup()
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_a_model_the_tenant_may_not_call_is_a_403_before_any_service_answers() -> None:
    """The 403 comes before the service is picked: a name whose services all weigh 0 answered the tenant a
    503 naming those services, and the gateway asked their engines' `/v1/models` for nothing."""
    gate = TenantGate(tenants(**{"team-a": {"models": ["alpha"]}}))

    async def test(url: str, engine: FakeEngine) -> None:
        with pytest.raises(openai.PermissionDeniedError) as other:
            await client(url, "team-a").completions.create(model="gamma", prompt="x", max_tokens=1)
        assert other.value.body["code"] == "model_not_allowed" and "team-b" not in other.value.body["message"]
        assert not engine.requests  # not even the served name's lookup

    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        # gamma weighs 0, out of the split: a 503 to those who may call it
        async with gateway_over(engine, [("team-a/alpha", 100), ("team-b/gamma", 0)], gate) as url:
            await test(url, engine)

    asyncio.run(asyncio.wait_for(main(), timeout=60))
