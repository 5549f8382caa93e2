"""Admin API: auth (403 without a configured token, 401 on a wrong one), limits (400), live changes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
ADMIN_TOKEN = "test-admin-token"  # tests/server/conftest.py starts the server with it
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def gauge(metrics_text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", metrics_text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.fixture
def restore_config(server: Any) -> Iterator[dict[str, int]]:
    before = httpx.get(f"{server.url}/admin/config", headers=AUTH).json()
    yield before
    assert httpx.patch(f"{server.url}/admin/config", headers=AUTH, json=before).status_code == 200


def test_admin_disabled_without_token_is_403(server: Any) -> None:
    token, server.state.admin_token = server.state.admin_token, None
    try:
        for resp in (
            httpx.get(f"{server.url}/admin/config", headers=AUTH),
            httpx.patch(f"{server.url}/admin/config", headers=AUTH, json={"max_num_seqs": 4}),
        ):
            assert resp.status_code == 403
            assert "SPECFLEET_ADMIN_TOKEN" in resp.json()["error"]["message"]
    finally:
        server.state.admin_token = token


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": ADMIN_TOKEN},
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
    ],
)
def test_wrong_or_missing_token_is_401(server: Any, headers: dict[str, str]) -> None:
    resp = httpx.patch(f"{server.url}/admin/config", headers=headers, json={"max_num_seqs": 4})
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/admin/config", headers=headers).status_code == 401


def test_get_config(server: Any) -> None:
    config = httpx.get(f"{server.url}/admin/config", headers=AUTH).json()
    assert set(config) == {
        "num_speculative_tokens",
        "max_num_seqs",
        "max_num_batched_tokens",
        "speculative_disable_by_batch_size",
    }


@pytest.mark.parametrize(
    ("body", "param", "limit"),
    [
        ({"num_speculative_tokens": 99}, "num_speculative_tokens", "8"),
        ({"max_num_seqs": 100000}, "max_num_seqs", "256"),
        ({"max_num_batched_tokens": 10**9}, "max_num_batched_tokens", "8192"),
        ({"max_num_seqs": 0}, "max_num_seqs", "1"),
        ({"speculative_disable_by_batch_size": 1000}, "speculative_disable_by_batch_size", "256"),
        ({"speculative_disable_by_batch_size": -1}, "speculative_disable_by_batch_size", "0"),
        ({"max_num_seqs": "many"}, "max_num_seqs", None),
        ({"block_size": 32}, "block_size", None),
    ],
)
def test_values_outside_limits_are_400_naming_the_limit(
    server: Any, body: dict[str, Any], param: str, limit: str | None
) -> None:
    before = httpx.get(f"{server.url}/admin/config", headers=AUTH).json()
    resp = httpx.patch(f"{server.url}/admin/config", headers=AUTH, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]
    if limit is not None:
        assert limit in error["message"], error["message"]
    assert httpx.get(f"{server.url}/admin/config", headers=AUTH).json() == before


def test_patch_while_16_requests_stream(
    server: Any, client: Any, model_name: str, restore_config: dict[str, int]
) -> None:
    prompts = ["Count from one to twenty:", "The alphabet is"]
    reference = {
        p: client.completions.create(
            model=model_name, prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    }
    new = {"num_speculative_tokens": 1, "max_num_seqs": 8, "speculative_disable_by_batch_size": 4}

    async def scenario() -> tuple[list[tuple[str, str | None]], dict[str, Any], str]:
        started = asyncio.Event()
        count = 0

        async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
            nonlocal count
            stream = await aclient.completions.create(
                model=model_name,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text, finish, first = "", None, True
            async for chunk in stream:
                if first:
                    first, count = False, count + 1
                    if count >= 4:
                        started.set()
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        async with (
            openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=180
            ) as aclient,
            httpx.AsyncClient(timeout=30) as http,
        ):
            tasks = [asyncio.ensure_future(one(aclient, prompts[i % 2])) for i in range(16)]
            await asyncio.wait_for(started.wait(), 120)
            patched = (await http.patch(f"{server.url}/admin/config", headers=AUTH, json=new)).json()
            await asyncio.sleep(0.5)  # at least one engine step applies it
            metrics = (await http.get(f"{server.url}/metrics")).text
            return await asyncio.gather(*tasks), patched, metrics

    results, patched, metrics = asyncio.run(scenario())
    assert patched["num_speculative_tokens"] == 1 and patched["max_num_seqs"] == 8
    assert gauge(metrics, "specfleet_num_speculative_tokens") == 1
    assert gauge(metrics, "specfleet_max_num_seqs") == 8
    assert gauge(metrics, "specfleet_speculative_disable_by_batch_size") == 4
    assert httpx.get(f"{server.url}/admin/config", headers=AUTH).json()["max_num_seqs"] == 8
    assert len(results) == 16
    for i, (text, finish) in enumerate(results):
        assert finish == "length"
        assert text == reference[prompts[i % 2]], (i, text)
    server.wait_idle()
    assert server.kv_blocks_in_use() == 0
