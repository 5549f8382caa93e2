"""What the replica knob reads from the routers: requests held with no engine ready (scale from zero),
the cold start they measured, and the replica count they see.

With zero replicas there is no engine to observe, so the routers' own gauges are the only signal: the
tuner scrapes each router pod's `/metrics` directly (the routers are few, and a scrape is one request),
whether or not it reads the engines through Prometheus. Several router pods each hold their own queue,
so queued requests are summed; the cold start is the longest any of them measured.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from specfleet.engine.knobs import REPLICAS

QUEUED = "specfleet_router_queued"
COLD_START = "specfleet_router_cold_start_seconds"


@dataclass(frozen=True)
class RouterSignals:
    queued: int = 0  # requests the routers hold waiting for a ready engine, summed over router pods
    cold_start_s: float | None = None  # the longest first-request wait the routers measured (scale from zero)
    replicas: int | None = None  # engines the routers know that are not draining (the most any router sees)
    routers: int = 0  # router pods that answered


def parse_router_metrics(text: str) -> RouterSignals:
    """One router's exposition; a gauge never set (no cold start yet) reads None."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (QUEUED, COLD_START, REPLICAS.gauge):
                values[sample.name] = float(sample.value)
    cold = values.get(COLD_START)
    replicas = values.get(REPLICAS.gauge)
    return RouterSignals(
        int(values.get(QUEUED, 0.0)), cold if cold else None, None if replicas is None else int(replicas), 1
    )


def combine(parts: list[RouterSignals]) -> RouterSignals:
    colds = [p.cold_start_s for p in parts if p.cold_start_s is not None]
    counts = [p.replicas for p in parts if p.replicas is not None]
    return RouterSignals(
        sum(p.queued for p in parts),
        max(colds) if colds else None,
        max(counts) if counts else None,
        sum(p.routers for p in parts),
    )


async def read_router_signals(client: httpx.AsyncClient, urls: list[str]) -> RouterSignals:
    """Scrape every router; one that does not answer is left out (its queue is unknown, not empty: with
    none answering, `routers` is 0 and the caller holds)."""

    async def one(url: str) -> RouterSignals | None:
        try:
            response = await client.get(f"{url}/metrics")
            response.raise_for_status()
            return parse_router_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            return None

    found = await asyncio.gather(*(one(u) for u in urls))
    return combine([s for s in found if s is not None])
