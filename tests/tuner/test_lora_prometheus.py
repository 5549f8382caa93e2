"""Per-adapter figures through a real Prometheus: two engine pods' metrics (tests/tuner/lora_pod.py: the
server's own registry, served over a socket) scraped every second by a Prometheus process; the tuner's
PromQL source reads each adapter's draft acceptance (rate over the window, by lora_name, summed over the
service's pods), its finished requests and the pods' adapter slots, and gives the same figures as the
direct-scrape source reading the same pods."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from specfleet.tuner.sources import PrometheusSource, ScrapeSource
from specfleet.tuner.types import Observation

from .lora_pod import Pod

pytestmark = pytest.mark.slow

TICK_S = 0.2  # the pods' load moves this often: several moves between two of Prometheus' 1 s scrapes
WINDOW_S = 4.0  # the sources' rate window: four scrapes


def _load(one: Pod, two: Pod, stop: threading.Event) -> None:
    """Each tick: sql's drafts accepted half the time on both pods, chat's a fifth on the first; sql's
    requests within any SLO below, chat's one in four within the TPOT target."""
    while not stop.is_set():
        with one.lock, two.lock:
            one.draft("sql", 8, 4)
            two.draft("sql", 4, 2)
            one.draft("chat", 10, 2)
            one.finish("sql", ttft=0.05, tpot=0.01, tokens=20)
            two.finish("sql", ttft=0.05, tpot=0.01, tokens=20)
            one.finish("chat", ttft=0.05, tpot=0.01, tokens=10)
            one.finish("chat", ttft=0.05, tpot=0.3, tokens=10, times=3)
        stop.wait(TICK_S)


def _same(prom: Observation, scrape: Observation) -> None:
    assert [n for n, _ in prom.lora_acceptance] == [n for n, _ in scrape.lora_acceptance] == ["chat", "sql"]
    for (_, a), (_, b), want in zip(prom.lora_acceptance, scrape.lora_acceptance, (0.2, 0.5), strict=True):
        assert a == pytest.approx(want) and b == pytest.approx(want)
    assert [a.name for a in prom.lora_requests] == [a.name for a in scrape.lora_requests] == ["chat", "sql"]
    for a, b in zip(prom.lora_requests, scrape.lora_requests, strict=True):
        for mine, theirs in ((a.tpot_cdf, b.tpot_cdf), (a.ttft_cdf, b.ttft_cdf)):
            assert [le for le, _ in mine] == [le for le, _ in theirs]
            assert [f for _, f in mine] == pytest.approx([f for _, f in theirs])
        # tokens/s: both over about a window of the same steady load (PromQL's rate extrapolates its edges)
        assert a.generation_rate == pytest.approx(b.generation_rate, rel=0.35)
    assert (prom.lora_slots, prom.lora_adapters) == (scrape.lora_slots, scrape.lora_adapters) == (2.0, 1.5)


def test_prometheus_and_scrape_sources_read_the_same_per_adapter_figures(prometheus_factory) -> None:
    one, two = Pod(), Pod()
    one.serve(["sql", "chat"])
    two.serve(["sql"])
    one.state.update(running=["sql"], waiting=["chat"])  # 2 adapters in demand on one pod, 1 on the other
    two.state.update(running=["sql"])
    urls = [one.start(), two.start()]
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(one, two, stop), daemon=True)
    load.start()
    try:
        prometheus = prometheus_factory("lora", urls)

        async def endpoints() -> list[str]:
            return urls

        async def observe() -> tuple[Observation, Observation]:
            source = PrometheusSource(prometheus, 'job="lora"', window_s=WINDOW_S)
            scrape = ScrapeSource(endpoints, window_s=WINDOW_S)
            try:
                deadline = time.monotonic() + 40.0
                await scrape.observe()
                while True:  # until Prometheus holds a window of both pods' adapters
                    await asyncio.sleep(1.0)
                    prom = await source.observe()
                    if len(prom.lora_acceptance) == 2 and prom.lora_slots is not None:
                        break
                    assert time.monotonic() < deadline, prom
                await asyncio.sleep(WINDOW_S)
                return await source.observe(), await scrape.observe()
            finally:
                await source.close()
                await scrape.close()

        prom, scrape = asyncio.run(observe())
    finally:
        stop.set()
        load.join()
        one.stop()
        two.stop()
    assert prom.error is None and scrape.error is None, (prom.error, scrape.error)
    _same(prom, scrape)
    # chat: one request in four within a 0.1 s TPOT target, as both sources read its histogram
    chat = next(a for a in prom.lora_requests if a.name == "chat")
    assert dict(chat.tpot_cdf)[0.1] == pytest.approx(0.25)
