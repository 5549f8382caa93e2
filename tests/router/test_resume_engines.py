"""Streams that survive their engine, with real engines: two engines (the tiny llama) behind the router,
32 concurrent streams (greedy, seeded, seeded with a presence penalty; completions and chat), one engine killed with SIGKILL
once the streams are about a third of the way through. Every stream must read exactly as the same request
read undisturbed, with one id and usage counted once (prompt: the client's prompt; completion: every
token generated, on either engine)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from helpers import start_server, stop_process
from specfleet.router.endpoints import EndpointSet
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router

from .test_proxy import start_router

pytestmark = pytest.mark.slow

STREAMS = 32
MAX_TOKENS = 32
ENGINE_ARGS = ("--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-gib", "0.05")


def request(i: int) -> dict[str, Any]:
    sampling = [
        {"temperature": 0},
        {"temperature": 1.0, "seed": i},
        {"temperature": 0.9, "seed": i, "presence_penalty": 0.5},
    ][i % 3]
    chat = i % 4 == 3  # a quarter are chat completions: the engine renders the same template again
    return {
        "model": "tiny",
        **(
            {"messages": [{"role": "user", "content": f"Story {i}: once upon a time"}]}
            if chat
            else {"prompt": f"Story {i}: once upon a time"}
        ),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


async def read(client: aiohttp.ClientSession, url: str, i: int, progress: list[int]) -> dict[str, Any]:
    text, ids, finish, usage = "", set(), None, None
    body = request(i)
    path = "chat/completions" if "messages" in body else "completions"
    async with client.post(f"{url}/v1/{path}", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            ids.add(data["id"])
            usage = data.get("usage") or usage
            for choice in data["choices"]:
                assert "token_ids" not in choice  # the router's extension stays between it and the engine
                text += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
                finish = choice["finish_reason"] or finish
                progress[i] += 1
    assert usage is not None
    return {"text": text, "ids": len(ids), "finish": finish, "usage": usage}


async def run_streams(url: str, progress: list[int]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        return await asyncio.gather(*(read(client, url, i, progress) for i in range(STREAMS)))


def kill_engine(proc: Any) -> None:
    """SIGKILL the engine server and its core process, as a node failure would."""
    parent = psutil.Process(proc.pid)
    for p in [*parent.children(recursive=True), parent]:
        os.kill(p.pid, signal.SIGKILL)


def test_streams_resume_token_for_token_after_an_engine_is_killed(tiny_llama: str, tmp_path: Path):
    started: dict[str, Any] = {}
    threads = [
        threading.Thread(
            target=lambda name=name: started.__setitem__(
                name, start_server(tmp_path / f"{name}.log", "--model", tiny_llama, *ENGINE_ARGS)
            )
        )
        for name in ("a", "b")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert set(started) == {"a", "b"}, "an engine did not start"
        asyncio.run(asyncio.wait_for(scenario(started["a"], started["b"][1]), timeout=150))
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                stop_process(proc)


async def scenario(victim: tuple[Any, str], survivor: str) -> None:
    proc, victim_url = victim
    router, url, runner = await start_router([victim_url, survivor])
    assert isinstance(router, Router) and isinstance(router.endpoints, EndpointSet)
    router.policy = make_policy("round-robin")
    try:
        undisturbed = await run_streams(url, [0] * STREAMS)
        progress = [0] * STREAMS
        streams = asyncio.ensure_future(run_streams(url, progress))
        while sum(progress) < STREAMS * MAX_TOKENS // 3 and not streams.done():
            await asyncio.sleep(0.01)
        kill_engine(proc)
        resumed = await streams
        assert sum(progress) < STREAMS * MAX_TOKENS  # the kill landed mid-way
    finally:
        await runner.cleanup()
    cut = router.metrics.resumed.labels("broken")._value.get()
    assert 1 <= cut <= STREAMS // 2 + 1, cut  # the victim's streams, about half of them, went on elsewhere
    for i, (before, after) in enumerate(zip(undisturbed, resumed, strict=True)):
        assert after["text"] == before["text"], (i, request(i))
        assert after["finish"] == before["finish"] == "length"
        assert after["ids"] == 1  # one stream to the client
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert after["usage"][key] == before["usage"][key], (i, key)
        assert after["usage"]["completion_tokens"] == MAX_TOKENS
