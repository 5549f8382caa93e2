"""The `--tenants` file is read again every --discovery-interval: a key taken out of it stops working within
one interval (before, the file was read once, so a revoked key went on working until a restart), a new one
starts working, and an edit that does not parse keeps the tenants last read while it is reported (where,
never the keys around it). Over real
sockets with the official openai client, the gate and its job built from the flags as `specfleet up` and
`specfleet router --gateway` build them (tenant_setup.build_gate); the engine is a stand-in
(tests/router/engines.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

import pytest
import yaml
from specfleet.router.tenant_setup import add_tenant_flags, build_gate

from .engines import FakeEngine, gateway_over
from .test_tenant_gate import answer_like_an_engine

openai = pytest.importorskip("openai")

OLD, NEW = "sk-team-a-old-0123456789abcdef", "sk-team-a-new-0123456789abcdef"
INTERVAL_S = 0.1


def tenants_file(*keys: str) -> str:
    return yaml.safe_dump({"tenants": [{"name": "team-a", "keys": list(keys)}]})


async def answers(url: str, key: str) -> bool:
    """Whether the gateway takes a completion with `key` (False: its 401)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    try:
        await client.completions.create(model="alpha", prompt="x", max_tokens=1)
        return True
    except openai.AuthenticationError:
        return False
    finally:
        await client.close()


async def until(url: str, key: str, expected: bool) -> float:
    """Seconds until the key's answer is `expected` (at most 5 s)."""
    start = time.monotonic()
    while await answers(url, key) != expected:
        assert time.monotonic() - start < 5, f"{key[:12]}... still {not expected}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_a_key_taken_out_of_the_file_stops_working_within_one_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_file(OLD))
    parser = argparse.ArgumentParser()
    add_tenant_flags(parser, cluster=False)
    args = parser.parse_args(["--tenants", str(path)])
    args.discovery_interval = INTERVAL_S
    gate, jobs = build_gate(args)
    assert gate is not None and len(jobs) == 1

    async def main() -> None:
        engine = await FakeEngine("engine-a", answer_like_an_engine).start()
        async with gateway_over(engine, [("ns/alpha", 100)], gate) as url:
            await rotate(url, [asyncio.create_task(job) for job in jobs])

    async def rotate(url: str, tasks: list[asyncio.Task[None]]) -> None:
        try:
            assert await answers(url, OLD) and not await answers(url, NEW)
            path.write_text(tenants_file(NEW))  # the rotation: the old key out, the new one in
            assert await until(url, NEW, True) < INTERVAL_S + 1.0
            assert not await answers(url, OLD)
            with caplog.at_level(logging.WARNING, logger="specfleet.router.tenants"):
                path.write_text("tenants:\n  - {name: team-a, keys: [sk-xyz]}\n")  # invalid: the last stay
                await asyncio.sleep(3 * INTERVAL_S)
                assert await answers(url, NEW)
                # not YAML: PyYAML's own message quotes the line, key and all; the log line names only where
                path.write_text(f"tenants:\n  - {{name: team-a, keys: [{NEW}, }}\n")
                await asyncio.sleep(3 * INTERVAL_S)
                assert await answers(url, NEW)
            assert "tenants[0].keys" in caplog.text and "not YAML at line 2, column" in caplog.text
            assert NEW not in caplog.text and "sk-xyz" not in caplog.text
            path.write_text(tenants_file(OLD))
            await until(url, NEW, False)
            assert await answers(url, OLD)
        finally:
            for task in tasks:
                task.cancel()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
