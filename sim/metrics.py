"""What a simulated engine reports: the counters, histograms and gauges of its /metrics, as a `Snapshot`.

The tuner reads simulated engines through the direct-scrape source's own arithmetic (`observe_pairs`
over `Snapshot`s), so the buckets are the engine's (`engine/server/metrics.py`) and the counters carry
the same names.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

from specfleet.engine.knobs import KNOBS, METRIC_PREFIX, LiveConfig
from specfleet.engine.server.metrics import (
    BATCH_BUCKETS,
    LATENCY_BUCKETS,
    STEP_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
)
from specfleet.tuner.snapshot import PER_POSITION, Snapshot

P = METRIC_PREFIX


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> dict[float, float]:
        out, running = {}, 0
        for le, c in zip((*self.bounds, math.inf), self.counts):
            running += c
            out[le] = float(running)
        return out


@dataclass
class EngineMetrics:
    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    requests: float = 0.0
    per_pos: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    shadow_per_pos: dict[int, float] = field(default_factory=dict)  # shadow drafts' (sim/shadow.py)
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {
            "time_to_first_token_seconds": Histogram(LATENCY_BUCKETS),
            "time_per_output_token_seconds": Histogram(TOKEN_LATENCY_BUCKETS),
            "e2e_request_latency_seconds": Histogram(LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(LATENCY_BUCKETS),
            "step_duration_seconds": Histogram(STEP_BUCKETS),
            "decode_step_duration_seconds": Histogram(STEP_BUCKETS),  # steps that computed no prompt token
            "batch_size": Histogram(BATCH_BUCKETS),
        }
    )

    def snapshot(self, now: float, running: int, waiting: int, kv_usage: float, live: LiveConfig) -> Snapshot:
        snap = Snapshot(now)
        snap.counters.update(self.counters)
        snap.requests = self.requests
        snap.per_pos[PER_POSITION[0]].update(self.per_pos)
        snap.per_pos[PER_POSITION[1]].update(self.shadow_per_pos)
        for name, h in self.histograms.items():
            snap.buckets[name].update(h.cumulative())
            snap.sums[name] = h.sum
            snap.counts[name] = float(h.count)
        snap.gauges = {
            P + "num_requests_running": float(running),
            P + "num_requests_waiting": float(waiting),
            P + "kv_cache_usage_ratio": kv_usage,
            **{knob.gauge: float(getattr(live, knob.name)) for knob in KNOBS},
        }
        return snap


class LogHistogram:
    """Percentiles of many values (every inter-token gap of a long run) in 1% wide buckets."""

    STEP = 0.01
    _LOG_BASE = math.log1p(STEP)

    def __init__(self) -> None:
        self.counts: dict[int, int] = defaultdict(int)
        self.total = 0

    def observe(self, value: float, times: int = 1) -> None:
        key = math.floor(math.log(max(value, 1e-9)) / self._LOG_BASE)
        self.counts[key] += times
        self.total += times

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0-100), at the geometric middle of its bucket."""
        if not self.total:
            return None
        rank, seen = q / 100.0 * self.total, 0
        for key in sorted(self.counts):
            seen += self.counts[key]
            if seen >= rank:
                return (1 + self.STEP) ** (key + 0.5)
        return None

    def mean(self) -> float | None:
        if not self.total:
            return None
        return sum((1 + self.STEP) ** (k + 0.5) * c for k, c in self.counts.items()) / self.total
