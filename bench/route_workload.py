"""`specfleet bench route`'s workload and client, shared by its phases (bench/route.py,
bench/route_eviction.py): the tenants' system prompts, their conversations, one streamed turn as the client
measures it, the engines' prefix-cache counters.

Tenants each have their own long system prompt (a handbook of a few hundred tokens); their conversations
of a few turns resend their whole history; the conversations are interleaved across tenants in a
deterministic shuffle.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

SUBJECTS = [
    "billing",
    "shipping",
    "returns",
    "warranty",
    "accounts",
    "security",
    "installation",
    "upgrades",
    "refunds",
    "loyalty points",
    "gift cards",
    "repairs",
]
QUESTIONS = [
    "How do I start?",
    "What does it cost?",
    "How long does it take?",
    "Can I cancel it?",
    "Who do I contact if it fails?",
    "Is there a limit?",
    "What do I need to bring?",
    "Can you summarise?",
]


@dataclass
class Turn:
    ttft: float
    e2e: float
    output_tokens: int
    ok: bool


def system_prompt(tenant: int, sentences: int) -> str:
    """A tenant's own handbook: distinct from its first words on, deterministic."""
    rng = random.Random(tenant)
    company = f"Company {chr(65 + tenant)}{tenant * 7919 % 1000}"
    lines = [f"You are the support assistant of {company}. Follow its handbook exactly."]
    for i in range(sentences):
        subject = rng.choice(SUBJECTS)
        lines.append(
            f"Rule {i + 1} of {company} on {subject}: handle case {rng.randint(100, 999)} within "
            f"{rng.randint(2, 30)} days, refer to form {rng.choice('ABCDEFGH')}-{rng.randint(10, 99)}."
        )
    return " ".join(lines)


def conversations(tenants: int, per_tenant: int, turns: int, seed: int) -> list[tuple[int, list[str]]]:
    """(tenant, user messages) per conversation, interleaved across tenants, deterministic."""
    rng = random.Random(seed)
    convs = [
        (t, [rng.choice(QUESTIONS) + f" (ticket {rng.randint(1000, 9999)})" for _ in range(turns)])
        for c in range(per_tenant)
        for t in range(tenants)
    ]
    rng.shuffle(convs)
    return convs


async def stream_turn(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], session: str
) -> tuple[Turn, str]:
    """One streamed chat completion or completion (`path`), greedy: its TTFT (first text), end-to-end
    time, output tokens (from the usage chunk) and text."""
    body = {**body, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, tokens = time.perf_counter(), 0.0, 0
    text: list[str] = []
    async with client.stream("POST", path, json=body, headers={"x-session-id": session}) as r:
        if r.status_code != 200:
            return Turn(0.0, time.perf_counter() - start, 0, False), ""
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece and not text:
                    ttft = time.perf_counter() - start
                text.append(piece)
            if data.get("usage"):
                tokens = data["usage"].get("completion_tokens", 0)
    return Turn(ttft, time.perf_counter() - start, tokens, bool(text)), "".join(text)


def counter(text: str, name: str) -> float:
    """A Prometheus exposition's `name` summed over its label sets (its `_created` samples left out)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(f"{name}_created") and " " in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """The engines' prefix-cache hits and queries (prompt tokens), summed over `urls`."""
    async with httpx.AsyncClient(timeout=10) as client:
        texts = [(await client.get(f"{u}/metrics")).text for u in urls]
    return (
        sum(counter(t, "specfleet_prefix_cache_hits") for t in texts),
        sum(counter(t, "specfleet_prefix_cache_queries") for t in texts),
    )


async def warm_up(urls: list[str]) -> None:
    """One short request straight to each engine (not through the router, no tenant's prefix): the first
    step of a fresh engine pays one-off costs that are no policy's doing."""
    async with httpx.AsyncClient(timeout=300) as client:
        for url in urls:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
            await client.post(
                f"{url}/v1/completions", json={"model": model, "prompt": "Warm up: 1 2 3 4", "max_tokens": 4}
            )
