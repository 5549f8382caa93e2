"""Per-tenant quotas: requests and tokens per minute, as token buckets in this process, and OpenAI's headers.

Each tenant has two buckets in each gateway replica, one of requests and one of tokens. A limit of L per
minute across R replicas gives each replica a bucket of L/R that refills at L/R per 60 s: with the load
spread evenly over the replicas (their Service does that) the fleet admits about L a minute, and a burst
of up to L/R at once per replica. R is the live replica count (tenant_discovery.ReplicaCount) and a change
rescales every bucket, keeping how full it is. For an exact limit whatever the spread, the gateway keeps
its counts in Redis instead (redis_limits.py).

Admission charges one request and the request's estimated tokens (the prompt's, plus `max_tokens`); the
end of the request reconciles the estimate with the usage the engine reported (`settle`). A request is
admitted when a whole request is left and its estimate fits in the tokens left; one whose estimate exceeds
the whole per-minute limit could never fit and is refused as too large, not asked to retry.

The headers are OpenAI's: `x-ratelimit-limit-{requests,tokens}`, `x-ratelimit-remaining-*` and
`x-ratelimit-reset-*` (the time until the bucket is full again, as a Go duration like OpenAI's `6m0s`, `1s`,
`20ms`), with `Retry-After` in whole seconds on a 429.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .tenants import Tenant

WINDOW_S = 60.0  # the limits are per minute


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: `6m0s`, `1s`, `1.5s`, `20ms`, `0s`."""
    if seconds <= 0:
        return "0s"
    millis = max(1, math.ceil(seconds * 1000))
    if millis < 1000:
        return f"{millis}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


@dataclass(frozen=True)
class Verdict:
    """One admission: allowed or not, and what the headers say about the tenant's limits after it."""

    allowed: bool
    limit_requests: int  # 0: no limit (the request headers are left out)
    limit_tokens: int
    remaining_requests: int
    remaining_tokens: int
    reset_requests_s: float
    reset_tokens_s: float
    retry_after_s: float = 0.0  # when refused: how long until it would be admitted
    too_large: bool = False  # refused because the estimate exceeds the whole per-minute limit

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit:
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, remaining))
                out[f"x-ratelimit-reset-{kind}"] = go_duration(reset)
        if not self.allowed and not self.too_large:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


class Limiter(Protocol):
    """Where the counts live: this process (LocalLimiter) or Redis (redis_limits.RedisLimiter)."""

    async def admit(self, tenant: Tenant, tokens: int) -> tuple[Verdict, object]:
        """Charge one request and `tokens` if both fit; the second value is handed back to `settle`."""
        ...

    async def settle(self, tenant: Tenant, ticket: object, delta_tokens: int) -> None:
        """Add `delta_tokens` (negative: a refund) to what the admitted request was charged."""
        ...


@dataclass
class Bucket:
    """A token bucket of `capacity` that refills at `capacity` per WINDOW_S; the level may go below zero
    when a request used more than its estimate (the debt delays the next admissions)."""

    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / WINDOW_S)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is in the bucket (0 when it is now)."""
        return max(0.0, (amount - self.level) * WINDOW_S / self.capacity)

    def rescale(self, capacity: float) -> None:
        """A new capacity, the bucket as full (in proportion) as it was."""
        self.level = self.level * capacity / self.capacity
        self.capacity = capacity


@dataclass
class _Buckets:
    requests: Bucket | None
    tokens: Bucket | None
    limits: tuple[int, int]  # the tenant's (rpm, tpm) these were built for


@dataclass
class LocalLimiter:
    """Token buckets in this process, each limit divided by the live replica count."""

    replicas: int = 1
    clock: Callable[[], float] = time.monotonic
    buckets: dict[str, _Buckets] = field(default_factory=dict)

    def set_replicas(self, replicas: int) -> None:
        """The live gateway replicas changed (at least 1 is this one): every bucket is rescaled."""
        self.replicas = max(1, replicas)
        now = self.clock()
        for b in self.buckets.values():
            for bucket, limit in ((b.requests, b.limits[0]), (b.tokens, b.limits[1])):
                if bucket is not None:
                    bucket.refill(now)
                    bucket.rescale(limit / self.replicas)

    def _of(self, tenant: Tenant, now: float) -> _Buckets:
        b = self.buckets.get(tenant.name)
        if b is None or b.limits != (tenant.rpm, tenant.tpm):  # new, or its limits were edited
            b = self.buckets[tenant.name] = _Buckets(
                self._carried(b.requests if b else None, tenant.rpm, now),
                self._carried(b.tokens if b else None, tenant.tpm, now),
                (tenant.rpm, tenant.tpm),
            )
        for bucket in (b.requests, b.tokens):
            if bucket is not None:
                bucket.refill(now)
        return b

    def _carried(self, old: Bucket | None, limit: int, now: float) -> Bucket | None:
        """This replica's bucket for a per-minute `limit` (None: no limit); after an edit of the limit what
        the tenant used of the old one stays used, so that an edit (the tenants file read again) does not
        hand out a full minute anew."""
        if not limit:
            return None
        capacity = limit / self.replicas
        if old is None:
            return Bucket(capacity, capacity, now)
        old.refill(now)
        return Bucket(capacity, min(capacity, capacity - (old.capacity - old.level)), now)

    def check(self, tenant: Tenant, tokens: int) -> Verdict:
        """Admit (and charge) one request of `tokens` estimated tokens, or say why not and until when."""
        now = self.clock()
        b = self._of(tenant, now)
        too_large = bool(tenant.tpm) and tokens > tenant.tpm
        # a replica's share may be below one request's estimate: then a full bucket is enough
        need_tokens = min(float(tokens), b.tokens.capacity) if b.tokens is not None else 0.0
        wait = max(
            b.requests.wait_for(1.0) if b.requests is not None else 0.0,
            b.tokens.wait_for(need_tokens) if b.tokens is not None else 0.0,
        )
        allowed = wait <= 0 and not too_large
        if allowed:
            if b.requests is not None:
                b.requests.level -= 1
            if b.tokens is not None:
                b.tokens.level -= tokens
        return self._verdict(b, allowed, wait, too_large)

    def _verdict(self, b: _Buckets, allowed: bool, wait: float, too_large: bool) -> Verdict:
        """The headers' view of the buckets: limit and remaining in this replica's share, scaled back up to
        the tenant's whole limit so that a client sees the numbers it was given."""
        r, t = b.requests, b.tokens
        return Verdict(
            allowed,
            b.limits[0],
            b.limits[1],
            int(r.level * self.replicas) if r is not None else 0,
            int(t.level * self.replicas) if t is not None else 0,
            r.wait_for(r.capacity) if r is not None else 0.0,
            t.wait_for(t.capacity) if t is not None else 0.0,
            wait,
            too_large,
        )

    async def admit(self, tenant: Tenant, tokens: int) -> tuple[Verdict, object]:
        return self.check(tenant, tokens), None

    async def settle(self, tenant: Tenant, ticket: object, delta_tokens: int) -> None:
        b = self.buckets.get(tenant.name)
        if b is not None and b.tokens is not None and delta_tokens:
            b.tokens.refill(self.clock())
            b.tokens.level = min(b.tokens.capacity, b.tokens.level - delta_tokens)
