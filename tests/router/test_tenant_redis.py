"""Exact tenant limits across gateway replicas through a real Redis (Debian's redis-server on a free port, no
persistence): two gateways on their own sockets share one tenant's requests-per-minute and tokens-per-minute
counts, so the fleet admits exactly the limit whichever replica each request reaches; a usage below the
estimate is given back to the shared window; with Redis gone each replica falls back to its own buckets."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import free_port, stop_process
from specfleet.router.gateway import Gateway, serve_gateway
from specfleet.router.quota import LocalLimiter
from specfleet.router.redis_limits import RedisLimiter, key_of
from specfleet.router.tenant_gate import TenantGate
from specfleet.router.tenants import Tenant, TenantSpec, TenantTable

from .engines import FakeEngine, engine_router
from .test_tenant_gate import KEYS, PROMPT_TOKENS, answer_like_an_engine

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if not Path(REDIS).exists():
        pytest.skip("redis-server is not installed (.ci/setup installs Debian's)")
    port = free_port()
    proc = subprocess.Popen(
        [
            REDIS,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                break
            except (redis.ConnectionError, redis.TimeoutError):  # not listening yet, or slow to answer
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc)


def team(**spec: Any) -> Tenant:
    return Tenant.of(TenantSpec.model_validate({"name": "team-a", "keys": [KEYS["team-a"]], **spec}))


async def gateways(engine: FakeEngine, limiters: list[Any], tenant: Tenant) -> list[tuple[str, Any]]:
    """One gateway per limiter, each on a socket of its own: (URL, its front)."""
    out = []
    for limiter in limiters:
        gateway = Gateway(tenants=TenantGate(TenantTable([tenant]), limiter))
        gateway.upsert("team-a/alpha", ["alpha"], 100, engine_router(engine))
        gateway.synced = True
        front = await serve_gateway(gateway, "127.0.0.1", 0)
        out.append((f"http://127.0.0.1:{front.port}", front))
    return out


async def statuses(urls: list[str], count: int, **body: Any) -> list[int]:
    """`count` completions, alternating between the gateways: each one's HTTP status."""
    seen = []
    for i in range(count):
        client = openai.AsyncOpenAI(
            base_url=f"{urls[i % len(urls)]}/v1", api_key=KEYS["team-a"], max_retries=0
        )
        try:
            await client.completions.create(model="alpha", prompt="abcd", **{"max_tokens": 1, **body})
            seen.append(200)
        except openai.APIStatusError as error:
            seen.append(error.status_code)
        finally:
            await client.close()
    return seen


def test_two_gateways_share_one_exact_limit_in_redis(redis_url: str) -> None:
    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        limiters = [RedisLimiter(redis_url), RedisLimiter(redis_url)]
        running = await gateways(engine, limiters, team(rpm=5))
        urls = [url for url, _ in running]
        try:
            # local buckets would admit 5 per replica, 10 in all; the shared window admits exactly 5
            assert await statuses(urls, 10) == [200] * 5 + [429] * 5
            client = openai.AsyncOpenAI(base_url=f"{urls[1]}/v1", api_key=KEYS["team-a"], max_retries=0)
            with pytest.raises(openai.RateLimitError) as over:
                await client.completions.create(model="alpha", prompt="abcd", max_tokens=1)
            await client.close()
            headers = over.value.response.headers
            assert (
                headers["x-ratelimit-limit-requests"] == "5"
                and headers["x-ratelimit-remaining-requests"] == "0"
            )
            assert 1 <= int(headers["Retry-After"]) <= 60  # the rest of the shared minute
            assert len([b for b in engine.requests if b]) == 5
        finally:
            for _, runner in running:
                await runner.cleanup()
            for limiter in limiters:
                await limiter.close()
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def test_tokens_are_settled_in_the_shared_window(redis_url: str) -> None:
    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        limiters = [RedisLimiter(redis_url), RedisLimiter(redis_url)]
        tenant = team(tpm=100)
        running = await gateways(engine, limiters, tenant)
        urls = [url for url, _ in running]
        try:
            # each asks for 1 (prompt) + 40 (max_tokens) but uses PROMPT_TOKENS + 40: with settling,
            # 100 // 43 = 2 fit; charged the estimate alone, 100 // 41 = 2 as well, and the window's count
            # tells the two apart
            assert await statuses(urls, 3, max_tokens=40) == [200, 200, 429]
            # a gateway settles after the answer's last byte went out (the client is not held for it), so
            # the window is read until the second settlement lands
            expected = {b"t": b"%d" % (2 * (PROMPT_TOKENS + 40)), b"r": b"2"}
            deadline = time.monotonic() + 10
            while True:
                counts = await limiters[0].client.hgetall(key_of(tenant))
                if {k: counts.get(k) for k in expected} == expected or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert {k: counts.get(k) for k in expected} == expected
        finally:
            for _, runner in running:
                await runner.cleanup()
            for limiter in limiters:
                await limiter.close()
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def test_without_redis_each_replica_falls_back_to_its_buckets() -> None:
    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        gone = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        limiter = RedisLimiter(gone, fallback=LocalLimiter(replicas=1, clock=lambda: 1000.0))
        running = await gateways(engine, [limiter], team(rpm=2))
        try:
            assert await statuses([running[0][0]], 3) == [200, 200, 429]
        finally:
            await running[0][1].cleanup()
            await limiter.close()
            await engine.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=120))
