"""Closed-loop load through the chat API, measured over a fixed window: what `bench tune` and `bench autoscale`
run in each phase.

Each of `concurrency` clients sends one streamed request after another for `seconds`; when the window
closes, the requests still in flight are cut (the client disconnects, so the engine aborts them). Goodput
is the output tokens that arrived inside the window from requests that meet the SLO, per second of window:
steady-state figures whatever the window's length. Counting only requests that finished inside the window,
as this did before, reads 0 when a window is shorter than one request (on a slow host, a 15 s static phase
of 32 streams at 48 tokens finished nothing) and stretches the window with a tail of falling concurrency.

A cut request is judged on what it had received: its TTFT, and its TPOT over the tokens so far; one that
had no token yet is judged only once it has waited longer than the TTFT SLO (a miss), otherwise it is too
young to judge and counts nowhere.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass, field

import httpx
from specfleet.bench.prompts import chat_prompts, grounded_prompts

RETRY_PAUSE_S = (
    0.1  # after a failed request, so a fleet that refuses everything is not hammered in a hot loop
)


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int
    grounded: bool
    max_tokens: int


_PROMPTS: dict[bool, list[str]] = {}


def _prompts(grounded: bool) -> list[str]:
    if grounded not in _PROMPTS:
        _PROMPTS[grounded] = grounded_prompts() if grounded else chat_prompts()
    return _PROMPTS[grounded]


def _prompt(phase: Phase, i: int) -> str:
    prompts = _prompts(phase.grounded)
    return prompts[i % len(prompts)]


# Where each client of each phase is in its prompt sequence: the phase's next window carries on from there,
# as a service's traffic does. Started afresh at the first prompt, every window of a phase would over-weight
# the head of the list: a 30 s static window of grounded-c1 sends ~15 of its 11 prompts (the first four
# twice), the tuner's 120 s one ~60 (each five or six times), and the prompts differ in length and in how
# much of them a draft can copy.
_NEXT: dict[tuple[str, int], int] = {}


def _body(prompt: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def prime(url: str, phases: tuple[Phase, ...]) -> int:
    """Every prompt the phases send, once, for one output token: each phase then meets the prefix cache as
    a service in steady state does. Without it the first phase of each prompt set pays every prompt's
    prefill and later measurements of the same set do not (grounded prompts are a few hundred tokens: the
    tuner's first pass at concurrency 1 read 53-65 tok/s at k=4 where the static passes of the same config
    read 70-85). Returns the number of prompts sent."""
    prompts = [text for grounded in sorted({p.grounded for p in phases}) for text in _prompts(grounded)]
    async with httpx.AsyncClient(timeout=300) as client:
        for text in prompts:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=_body(text, 1)) as response:
                response.raise_for_status()
                async for _ in response.aiter_lines():
                    pass
    return len(prompts)


@dataclass
class Stream:
    """One request as its client saw it: when it was sent, and its output token count at each chunk."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, output tokens so far)
    finished: bool = False
    failed: bool = False

    def tokens(self, end: float) -> int:
        """Output tokens that had arrived by `end`."""
        return max((n for t, n in self.arrivals if t <= end), default=0)

    def meets(self, end: float, slo: tuple[float, float]) -> bool | None:
        """Whether the request meets the SLO (TTFT, TPOT in seconds) on what had arrived by `end`; None
        when it is too young to tell (no token yet, and not yet waiting past the TTFT SLO)."""
        if self.failed:
            return False
        seen = [(t, n) for t, n in self.arrivals if t <= end and n > 0]
        if not seen:
            return None if end - self.sent <= slo[0] else False
        return seen[0][0] - self.sent <= slo[0] and (self.tpot(end) or 0.0) <= slo[1]

    def tpot(self, end: float) -> float | None:
        """Seconds per output token after the first, over what had arrived by `end`; None under two tokens."""
        seen = [(t, n) for t, n in self.arrivals if t <= end and n > 0]
        if not seen or seen[-1][1] < 2:
            return None
        (first_t, _), (last_t, last_n) = seen[0], seen[-1]
        return (last_t - first_t) / (last_n - 1)


def window_figures(
    streams: list[Stream], start: float, end: float, slo: tuple[float, float]
) -> dict[str, float]:
    """goodput and throughput (output tokens per second of the window), the requests judged, their SLO
    attainment and TPOT p95, and the window's length."""
    seconds = max(end - start, 1e-9)
    verdicts = [(s, s.meets(end, slo)) for s in streams]
    judged = [(s, ok) for s, ok in verdicts if ok is not None]
    good = sum(s.tokens(end) for s, ok in judged if ok)
    tpots = sorted(t for s, _ in judged if (t := s.tpot(end)) is not None)
    return {
        "goodput": good / seconds,
        "throughput": sum(s.tokens(end) for s in streams) / seconds,
        "requests": len(judged),
        "finished": sum(1 for s in streams if s.finished and s.arrivals and s.arrivals[-1][0] <= end),
        "slo_attainment": sum(1 for _, ok in judged if ok) / len(judged) if judged else 0.0,
        "seconds": seconds,
        # the requests' TPOT (each over its own tokens, as the SLO judges it) at the 95th percentile; 0 if none
        "tpot_p95_s": tpots[math.ceil(0.95 * len(tpots)) - 1] if tpots else 0.0,  # nearest rank
    }


async def _send(client: httpx.AsyncClient, url: str, phase: Phase, i: int, stream: Stream) -> None:
    """One streamed chat request, greedy, stopping at EOS (a grounded answer ends with the copied passage,
    and tokens forced past EOS would be unrelated free text); each chunk's usage is recorded as it comes."""
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=_body(_prompt(phase, i), phase.max_tokens)
        ) as response:
            if response.status_code != 200:
                stream.failed = True
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    stream.arrivals.append((time.monotonic(), int(usage["completion_tokens"])))
        stream.finished = True
    except httpx.HTTPError:
        stream.failed = True


async def run_phase(url: str, phase: Phase, seconds: float, slo: tuple[float, float]) -> dict[str, float]:
    """Closed-loop load for `seconds`, then the requests in flight are cut; the window's figures."""
    streams: list[Stream] = []
    async with httpx.AsyncClient(timeout=300) as client:

        async def client_loop(w: int) -> None:
            for i in itertools.count(_NEXT.get((phase.name, w), 0)):
                _NEXT[(phase.name, w)] = i + 1
                stream = Stream(time.monotonic())
                streams.append(stream)
                await _send(client, url, phase, w * 10000 + i, stream)
                if stream.failed:
                    await asyncio.sleep(RETRY_PAUSE_S)

        start = time.monotonic()
        loops = [asyncio.create_task(client_loop(w)) for w in range(phase.concurrency)]
        try:
            await asyncio.sleep(seconds)
        finally:  # also when the benchmark is stopped: no client outlives the connection pool
            end = time.monotonic()
            for loop in loops:
                loop.cancel()
            failures = [
                r for r in await asyncio.gather(*loops, return_exceptions=True) if isinstance(r, Exception)
            ]
            if failures:  # a bug in the client, not a failed request (those are counted, not raised)
                raise failures[0]
    return window_figures(streams, start, end, slo)
