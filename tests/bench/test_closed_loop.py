"""The closed-loop window that `bench tune` and `bench autoscale` measure with: the figures of a window from the
streams a client saw, and the load itself against a real uvicorn server that streams at a known pace."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from helpers import serve_in_thread
from specfleet.bench.closed_loop import Phase, Stream, prime, run_phase, window_figures
from specfleet.bench.prompts import chat_prompts, grounded_prompts
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

SLO = (0.5, 0.1)  # TTFT, TPOT in seconds


def paced(sent: float, ttft: float, tpot: float, tokens: int, finished: bool = True) -> Stream:
    """A stream whose first token came `ttft` after `sent` and each later one `tpot` apart."""
    arrivals = [(sent + ttft + i * tpot, i + 1) for i in range(tokens)]
    return Stream(sent, arrivals, finished=finished)


def test_a_window_counts_the_tokens_that_arrived_in_it_from_requests_meeting_the_slo() -> None:
    streams = [
        paced(0.0, 0.2, 0.05, 20),  # finished inside the window, within the SLO: 20 good tokens
        paced(0.0, 0.2, 0.3, 10),  # finished, TPOT 300 ms: a miss, its tokens count only as throughput
        paced(5.0, 0.12, 0.05, 200, finished=False),  # cut at 10 s: 98 tokens so far, on pace
        paced(9.0, 0.7, 0.05, 5, finished=False),  # first token after the TTFT SLO: a miss
        Stream(9.9),  # sent 100 ms before the window closed, no token yet: too young to judge
        Stream(9.0),  # waiting 1 s with no token: already a TTFT miss
        Stream(2.0, failed=True),  # refused: a miss
    ]
    out = window_figures(streams, 0.0, 10.0, SLO)
    cut = streams[2].tokens(10.0)
    assert cut == 98  # tokens that arrived after the window closed are not counted
    assert out["goodput"] == pytest.approx((20 + cut) / 10)
    assert out["throughput"] == pytest.approx((20 + 10 + cut + 5) / 10)  # every token counts as throughput
    assert out["requests"] == 6 and out["slo_attainment"] == pytest.approx(2 / 6)
    assert out["finished"] == 2 and out["seconds"] == 10.0


def test_a_request_is_judged_on_what_had_arrived_by_the_end() -> None:
    slow_later = paced(0.0, 0.1, 0.05, 10)
    slow_later.arrivals.append((5.0, 11))  # a stall after the window closed does not count against it
    assert slow_later.meets(1.0, SLO) is True and slow_later.meets(6.0, SLO) is False
    one_token = paced(0.0, 0.3, 0.0, 1, finished=False)  # a single token: judged on its TTFT alone
    assert one_token.meets(1.0, SLO) is True
    assert window_figures([], 0.0, 1.0, SLO)["slo_attainment"] == 0.0


def test_tpot_p95_is_the_nearest_rank_of_the_judged_requests_own_tpot() -> None:
    """Each request's TPOT over its own tokens (as the SLO judges it), p95 by nearest rank over the judged
    requests: 20 requests at 10..200 ms read 190 ms; a request with one token or none has no TPOT."""
    streams = [paced(0.0, 0.1, (i + 1) / 100, 5) for i in range(20)]
    streams += [paced(0.0, 0.1, 0.0, 1), Stream(0.0, failed=True)]
    out = window_figures(streams, 0.0, 10.0, (0.5, 1.0))
    assert out["tpot_p95_s"] == pytest.approx(0.19)
    assert streams[0].tpot(10.0) == pytest.approx(0.01) and streams[20].tpot(10.0) is None
    assert streams[1].tpot(0.1 + 0.02 * 2) == pytest.approx(0.02)  # over the tokens arrived by then
    assert window_figures([], 0.0, 1.0, SLO)["tpot_p95_s"] == 0.0


TOKEN_GAP_S = 0.05  # the fake engine's pace: 20 tokens per second per stream


@pytest.fixture
def paced_server() -> Iterator[tuple[str, dict[str, list[Any]]]]:
    """A real uvicorn server streaming chat chunks with continuous usage at TOKEN_GAP_S per token; it records
    each stream's end (finished or cut by the client's disconnect). Under /refuse every request gets a 503."""
    seen: dict[str, list[Any]] = {"ended": [], "finished": [], "prompts": []}
    lock = threading.Lock()

    async def chat(request: Request) -> Any:
        body = await request.json()
        with lock:
            seen["prompts"].append((body["messages"][0]["content"], body["max_tokens"]))

        async def events() -> AsyncIterator[str]:
            done = False
            try:
                for n in range(1, body["max_tokens"] + 1):
                    await asyncio.sleep(TOKEN_GAP_S)
                    chunk = {"choices": [{"delta": {"content": "x"}}], "usage": {"completion_tokens": n}}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
            finally:
                with lock:
                    seen["ended"].append(True)
                    seen["finished"].append(done)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def refuse(request: Request) -> Any:
        return JSONResponse({"error": "no engine ready"}, status_code=503)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/refuse/v1/chat/completions", refuse, methods=["POST"]),
        ]
    )
    server, thread, url = serve_in_thread(app)
    try:
        yield url, seen
    finally:
        server.should_exit = True
        thread.join(10)


def test_requests_longer_than_the_window_still_measure_and_are_cut_at_its_end(
    paced_server: tuple[str, dict[str, list[Any]]],
) -> None:
    """Three streams of 200 tokens (10 s each) in a 1.5 s window: none finishes, yet goodput reads about the
    pace (3 x 20 tok/s), and each request is cut when the window closes, so the server sees it end."""
    url, seen = paced_server
    out = asyncio.run(run_phase(url, Phase("long", 3, False, 200), 1.5, (1.0, 0.2)))
    # Bounds for a loaded host (a second pytest worker, other jobs): the server shares this process, and its
    # 50 ms sleeps stretch (load 20 on 2 cores read 42 tok/s). Still at least one stream on pace, and the cut
    # requests' tokens counted, well above nothing and never above the pace.
    assert out["finished"] == 0 and out["requests"] == 3 and out["slo_attainment"] >= 1 / 3, out
    assert 0.3 * 60 <= out["goodput"] <= 1.05 * 60 and out["goodput"] == out["throughput"], out
    assert 1.5 <= out["seconds"] < 2.0  # the window, not the requests' length
    deadline = time.monotonic() + 5
    while len(seen["ended"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen["finished"] == [False, False, False]  # the disconnect reached the server: none ran on


def test_short_requests_loop_and_refusals_are_misses_without_a_hot_loop(
    paced_server: tuple[str, dict[str, list[Any]]],
) -> None:
    url, _ = paced_server
    out = asyncio.run(run_phase(url, Phase("short", 2, False, 4), 1.0, (1.0, 0.2)))
    # 4 tokens take 0.2 s: ~5 requests per stream on an idle host. The server shares this process and the
    # host's 2 cores with the other tests (`pytest -n 2`): at least one stream must have looped (3 finished
    # of 2 streams), and most requests must meet an SLO with 4x the pace's TPOT, where refusals meet none.
    assert out["finished"] >= 3 and out["slo_attainment"] >= 0.5, out
    refused = asyncio.run(run_phase(f"{url}/refuse", Phase("refused", 2, False, 4), 1.0, (1.0, 0.2)))
    assert refused["goodput"] == 0 and refused["slo_attainment"] == 0.0
    assert 2 <= refused["requests"] <= 2 * (1.0 / 0.1 + 1)  # paced by the retry pause, not a hot loop


def test_a_phase_carries_on_through_its_prompts_from_one_window_to_the_next(
    paced_server: tuple[str, dict[str, list[Any]]],
) -> None:
    """A second window of a phase starts where the first left off, so short windows sample the prompt
    list as a long one does instead of each sending its head again."""
    url, seen = paced_server
    seen["prompts"].clear()
    phase = Phase("carry-on", 1, True, 2)  # 2 tokens at 50 ms: a few requests per 0.35 s window
    asyncio.run(run_phase(url, phase, 0.35, (1.0, 0.2)))
    first = [text for text, _ in seen["prompts"]]
    asyncio.run(run_phase(url, phase, 0.35, (1.0, 0.2)))
    second = [text for text, _ in seen["prompts"]][len(first) :]
    prompts = grounded_prompts()
    assert 2 <= len(first) < len(prompts) and second, (len(first), len(second))
    assert first == prompts[: len(first)]
    assert second[0] == prompts[len(first)]  # not prompts[0] again


def test_prime_sends_every_prompt_of_the_phases_once_for_one_token(
    paced_server: tuple[str, dict[str, list[Any]]],
) -> None:
    """Before the first measurement every prompt a phase may send is seen once (one output token), so each
    phase meets the same warm prefix cache; a prompt set no phase uses is not sent."""
    url, seen = paced_server
    phases = (Phase("g", 1, True, 8), Phase("c", 4, False, 8), Phase("c2", 2, False, 8))
    sent = asyncio.run(prime(url, phases))
    expected = chat_prompts() + grounded_prompts()
    assert sent == len(expected) and sorted(seen["prompts"]) == sorted((text, 1) for text in expected)
    seen["prompts"].clear()
    assert asyncio.run(prime(url, (Phase("c", 4, False, 8),))) == len(chat_prompts())
    assert {text for text, _ in seen["prompts"]} == set(chat_prompts())
