"""Histogram arithmetic shared by both sources: Prometheus' histogram_quantile and CDF lookups.

Buckets are cumulative counts by upper bound `le` (the last one +Inf), as Prometheus exposes them; the
quantile interpolates linearly inside a bucket exactly as PromQL's `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .types import Cdf


def sort_buckets(buckets: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    return sorted(((float(le), float(count)) for le, count in buckets), key=lambda b: b[0])


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """PromQL `histogram_quantile(q, ...)` over cumulative (le, count) pairs; None when there are none."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q} must lie in [0, 1]")
    ordered = sort_buckets(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    total = ordered[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower_bound  # PromQL: the upper bound of the highest finite bucket
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return ordered[-2][0]


def to_cdf(buckets: Iterable[tuple[float, float]]) -> Cdf:
    """Cumulative fractions by finite upper bound; empty when the window saw no observations."""
    ordered = sort_buckets(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return []
    total = ordered[-1][1]
    return [(le, min(1.0, count / total)) for le, count in ordered if not math.isinf(le)]


def fraction_below(cdf: Cdf, threshold: float) -> float | None:
    """P(value <= threshold), linearly interpolated inside the bucket; None without data."""
    if not cdf:
        return None
    lower_bound, lower_frac = 0.0, 0.0
    for le, frac in cdf:
        if threshold <= le:
            if le == lower_bound:
                return frac
            return lower_frac + (frac - lower_frac) * (threshold - lower_bound) / (le - lower_bound)
        lower_bound, lower_frac = le, frac
    # beyond the last finite bucket: only what the last finite bucket says is known to be below
    return lower_frac if threshold < math.inf else 1.0


def subtract(
    after: list[tuple[float, float]], before: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Bucket counts gained between two scrapes (a counter reset restarts from `after`)."""
    previous = dict(before)
    deltas = [(le, count - previous.get(le, 0.0)) for le, count in after]
    if any(delta < 0 for _, delta in deltas):
        return list(after)
    return deltas
