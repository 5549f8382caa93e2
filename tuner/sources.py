"""Where observations come from: Prometheus' HTTP API (PromQL) or a direct scrape of each engine.

Both return the same `Observation`; neither raises on a dead backend: the observation then carries
`error`, which the policy turns into "hold the last good config" with the error in its reason.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import httpx
from specfleet.engine.knobs import SEARCHED

from .snapshot import (
    COUNTERS,
    HISTOGRAMS,
    LORA_ADAPTERS,
    LORA_DRAFTS,
    LORA_INFO,
    LORA_LATENCY,
    LORA_SLOTS,
    LORA_TOKENS,
    PER_POSITION,
    P,
    PerAdapterBuckets,
    Snapshot,
    acceptance_by_adapter,
    adapter_requests,
    build_observation,
    lora_info_gauges,
    observe_pairs,
    parse_metrics,
)
from .types import Observation, TunedConfig

Endpoints = Callable[[], Awaitable[list[str]]]  # base URLs (http://host:port) of the ready pods


class Source(Protocol):
    async def observe(self) -> Observation: ...

    async def close(self) -> None: ...


LATENCY = ("time_to_first_token_seconds", "time_per_output_token_seconds")


class ScrapeSource:
    """Scrapes every endpoint's /metrics each call; rates and latency histograms are the difference from
    the newest earlier scrape of the same pod that is at least `window_s` old (the first ones: the oldest
    there is), like Prometheus' `rate(...[window])`.

    Under a heavy load, requests finish in waves (TTFT and TPOT are recorded when a request finishes), so
    a window can hold no finished request at all while tokens flow. Then the base moves further back, up
    to `max_window_factor` windows, so that latency is estimated from the last finished requests instead
    of being reported missing.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        timeout_s: float = 5.0,
        window_s: float = 0.0,
        max_window_factor: float = 4.0,
    ) -> None:
        self.endpoints = endpoints
        self.window_s = window_s
        self.max_window_factor = max_window_factor
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._history: dict[str, list[Snapshot]] = {}

    async def _scrape(self, url: str) -> Snapshot | None:
        try:
            response = await self._client.get(f"{url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        return parse_metrics(response.text, time.monotonic())

    def _base(self, history: list[Snapshot], snap: Snapshot) -> Snapshot:
        """The newest earlier scrape at least a window old; older while no request finished since."""
        earlier = history[:-1]
        base = next((s for s in reversed(earlier) if snap.time - s.time >= self.window_s), earlier[0])
        for older in reversed(earlier[: earlier.index(base) + 1]):
            if snap.time - older.time > self.max_window_factor * max(self.window_s, 1e-9):
                break
            base = older
            if snap.requests > older.requests:
                break
        return base

    async def observe(self) -> Observation:
        urls = await self.endpoints()
        snaps = await asyncio.gather(*(self._scrape(u) for u in urls))
        pairs = []
        horizon = self.max_window_factor * self.window_s
        for url, snap in zip(urls, snaps, strict=True):
            if snap is None:
                continue
            history = self._history.setdefault(url, [])
            if history and snap.requests < history[-1].requests:
                history.clear()  # the pod restarted: its counters began again
            history.append(snap)
            beyond = [s for s in history if snap.time - s.time > horizon]
            history[:] = beyond[-1:] + [s for s in history if snap.time - s.time <= horizon]
            if len(history) >= 2:
                pairs.append((self._base(history, snap), snap))
        self._history = {u: h for u, h in self._history.items() if u in urls}
        now = time.monotonic()
        if not any(s is not None for s in snaps):
            return Observation(
                time=now, config=None, error=f"none of {len(urls)} engine(s) answered /metrics"
            )
        if not pairs:
            return Observation(time=now, config=None, error="first scrape: rates need a second one")
        return observe_pairs(pairs, now)

    async def close(self) -> None:
        await self._client.aclose()


class PrometheusSource:
    """PromQL over the Prometheus HTTP API; `selector` picks the service's series, e.g. `job="smollm2"`.

    When no request finished inside the window (under heavy load they finish in waves), the latency
    histograms are read again over `max_window_factor` windows, as the scrape source does.
    """

    def __init__(
        self,
        url: str,
        selector: str,
        window_s: float = 30.0,
        timeout_s: float = 5.0,
        max_window_factor: float = 4.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.selector = selector
        self.window = f"{max(int(window_s), 2)}s"
        self.long_window = f"{max(int(window_s * max_window_factor), 2)}s"
        self._client = httpx.AsyncClient(timeout=timeout_s)

    def _rate(self, metric: str, window: str) -> str:
        return f"sum(rate({metric}{{{self.selector}}}[{window}]))"

    def queries(self, window: str | None = None) -> dict[str, str]:
        """Every PromQL query one observation runs, by name."""
        s, w = self.selector, window or self.window
        q = {f"rate:{c}": self._rate(f"{P}{c}_total", w) for c in COUNTERS}
        q["rate:requests"] = self._rate(f"{P}request_success_total", w)
        for family in PER_POSITION:
            q[f"per_pos:{family}"] = f"sum by (position) (rate({P}{family}_total{{{s}}}[{w}]))"
        for h in HISTOGRAMS:
            q[f"buckets:{h}"] = f"sum by (le) (rate({P}{h}_bucket{{{s}}}[{w}]))"
            q[f"sum:{h}"] = self._rate(f"{P}{h}_sum", w)
            q[f"count:{h}"] = self._rate(f"{P}{h}_count", w)
        for h in LATENCY:
            q[f"p95:{h}"] = f"histogram_quantile(0.95, sum by (le) (rate({P}{h}_bucket{{{s}}}[{w}])))"
        # per LoRA adapter (label lora_name), summed over the service's pods: draft and accepted tokens, the
        # finished requests' output tokens and latency buckets; and each pod's vllm:lora_requests_info sample
        for family in (*LORA_DRAFTS, LORA_TOKENS):
            q[f"lora:{family}"] = f"sum by (lora_name) (rate({P}{family}_total{{{s}}}[{w}]))"
        for h in LORA_LATENCY:
            q[f"lora:{h}"] = f"sum by (lora_name, le) (rate({P}{h}_bucket{{{s}}}[{w}]))"
        q["lora:info"] = f"{LORA_INFO}{{{s}}}"
        q["running"] = f"sum({P}num_requests_running{{{s}}})"
        q["waiting"] = f"sum({P}num_requests_waiting{{{s}}})"
        q["kv"] = f"max({P}kv_cache_usage_ratio{{{s}}})"
        q["pods"] = f"count({SEARCHED[0].gauge}{{{s}}})"  # every pod reports each config gauge once
        for knob in SEARCHED:
            q[f"min:{knob.name}"] = f"min({knob.gauge}{{{s}}})"
            q[f"max:{knob.name}"] = f"max({knob.gauge}{{{s}}})"
        return q

    async def _query(self, promql: str) -> list[dict[str, Any]]:
        response = await self._client.get(f"{self.url}/api/v1/query", params={"query": promql})
        response.raise_for_status()
        body = response.json()
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {promql!r}: {body.get('error')}")
        return body["data"]["result"]

    async def observe(self) -> Observation:
        now = time.monotonic()
        queries = self.queries()
        try:
            results = dict(
                zip(queries, await asyncio.gather(*(self._query(q) for q in queries.values())), strict=True)
            )
        except (httpx.HTTPError, RuntimeError, ValueError) as error:
            return Observation(
                time=now, config=None, error=f"Prometheus at {self.url} unreachable or failing: {error}"
            )

        def scalar(name: str) -> float | None:
            rows = results[name]
            if not rows:
                return None
            value = float(rows[0]["value"][1])
            return None if math.isnan(value) else value

        if scalar("pods") and not any(scalar(f"count:{h}") for h in LATENCY):
            longer = {
                k: v for k, v in self.queries(self.long_window).items() if k.split(":", 1)[-1] in LATENCY
            }
            try:
                results.update(
                    zip(longer, await asyncio.gather(*(self._query(q) for q in longer.values())), strict=True)
                )
            except (httpx.HTTPError, RuntimeError, ValueError):
                pass  # latency stays missing; the rest of the observation holds
        if not scalar("pods"):
            return Observation(
                time=now, config=None, error=f"Prometheus has no series for {{{self.selector}}} yet"
            )
        rates = {c: scalar(f"rate:{c}") or 0.0 for c in COUNTERS}
        rates["requests"] = scalar("rate:requests") or 0.0
        per_pos = {
            family: {
                int(r["metric"].get("position", 0)): float(r["value"][1])
                for r in results[f"per_pos:{family}"]
            }
            for family in PER_POSITION
        }
        buckets = {
            h: [(float(r["metric"]["le"]), float(r["value"][1])) for r in results[f"buckets:{h}"]]
            for h in HISTOGRAMS
        }
        sums = {h: scalar(f"sum:{h}") or 0.0 for h in HISTOGRAMS}
        counts = {h: scalar(f"count:{h}") or 0.0 for h in HISTOGRAMS}
        config = None
        lows = {knob.name: scalar(f"min:{knob.name}") for knob in SEARCHED}
        highs = {knob.name: scalar(f"max:{knob.name}") for knob in SEARCHED}
        if None not in lows.values() and lows == highs:  # every pod runs the same config
            config = TunedConfig.from_admin(lows)  # type: ignore[arg-type]
        obs = build_observation(
            now,
            rates,
            per_pos,
            buckets,
            sums,
            counts,
            scalar("running") or 0.0,
            scalar("waiting") or 0.0,
            scalar("kv") or 0.0,
            config,
            int(scalar("pods") or 0),
        )
        obs = _with_lora(obs, results)
        # PromQL's own histogram_quantile is the figure operators see on dashboards: report it.
        return _with_p95(
            obs, scalar("p95:time_to_first_token_seconds"), scalar("p95:time_per_output_token_seconds")
        )

    async def close(self) -> None:
        await self._client.aclose()


def _with_lora(obs: Observation, results: dict[str, list[dict[str, Any]]]) -> Observation:
    """The per-adapter figures from the `lora:*` queries' answers, as the scrape source reads them."""

    def by_adapter(name: str) -> dict[str, float]:
        rows = results[f"lora:{name}"]
        return {r["metric"].get("lora_name", ""): float(r["value"][1]) for r in rows}

    buckets: PerAdapterBuckets = {}
    for h in LORA_LATENCY:
        buckets[h] = {}
        for r in results[f"lora:{h}"]:
            le = float(r["metric"]["le"])
            buckets[h].setdefault(r["metric"].get("lora_name", ""), []).append((le, float(r["value"][1])))
    info = [lora_info_gauges(r["metric"]) for r in results["lora:info"]]
    changes: dict[str, Any] = {
        "lora_acceptance": acceptance_by_adapter(by_adapter(LORA_DRAFTS[0]), by_adapter(LORA_DRAFTS[1])),
        "lora_requests": adapter_requests(by_adapter(LORA_TOKENS), buckets),
    }
    if info:  # a pod's one sample: its slots and the adapters in demand on it, mean over pods
        changes["lora_slots"] = sum(g[LORA_SLOTS] for g in info) / len(info)
        changes["lora_adapters"] = sum(g[LORA_ADAPTERS] for g in info) / len(info)
    return replace(obs, **changes)


def _with_p95(obs: Observation, ttft: float | None, tpot: float | None) -> Observation:
    return replace(
        obs,
        ttft_p95_s=ttft if ttft is not None else obs.ttft_p95_s,
        tpot_p95_s=tpot if tpot is not None else obs.tpot_p95_s,
    )
