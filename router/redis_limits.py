"""Exact per-tenant limits shared by every gateway replica, kept in Redis (`--redis-url`).

One hash per tenant, `specfleet:tenant:{NAME}` (the braces are a Redis Cluster hash tag: one slot), holds
the window's request count `r`, token count `t` and id `w`; it expires one window (60 s) after the
window's first request, so a window is a fixed minute that starts with the first request after the last
one ended (LiteLLM's proxy and Envoy's global rate limit count fixed windows too). One Lua script checks
both limits and charges both counts atomically, so two replicas can never admit the same last request.
`settle` adds the difference between the real usage and the estimate to the window that was charged, and
to no other (the window id must still match).

When Redis cannot be reached the replica falls back to its local buckets (quota.LocalLimiter, sized by the
replica count) and logs it once per outage: the limits hold approximately rather than refusing everyone
(LiteLLM does the same).
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .quota import WINDOW_S, LocalLimiter, Verdict
from .tenants import Tenant

logger = logging.getLogger("specfleet.router.tenants")

# KEYS[1]: the tenant's hash. ARGV: rpm, tpm (0: unlimited), the request's tokens, window ms, a new window id.
# Returns {allowed (0/1), requests counted, tokens counted, ms left in the window, the window's id}.
ADMIT = """
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r = tonumber(redis.call('HGET', KEYS[1], 'r') or '0')
local t = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
local ttl = redis.call('PTTL', KEYS[1])
local w = redis.call('HGET', KEYS[1], 'w')
if ttl < 0 or not w then
  r, t, ttl, w = 0, 0, tonumber(ARGV[4]), ARGV[5]
end
local fits = (rpm == 0 or r + 1 <= rpm) and (tpm == 0 or t + cost <= tpm)
if fits then
  r = redis.call('HINCRBY', KEYS[1], 'r', 1)
  t = redis.call('HINCRBY', KEYS[1], 't', cost)
  if redis.call('HSETNX', KEYS[1], 'w', w) == 1 then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
end
return {fits and 1 or 0, r, t, ttl, w}
"""
# KEYS[1]: the tenant's hash. ARGV: the window id charged, the tokens to add (negative: a refund).
SETTLE = """
if redis.call('HGET', KEYS[1], 'w') == ARGV[1] then
  return redis.call('HINCRBY', KEYS[1], 't', ARGV[2])
end
return nil
"""


def key_of(tenant: Tenant) -> str:
    return f"specfleet:tenant:{{{tenant.name}}}"


def redacted(url: str) -> str:
    """The URL as the logs show it: its password (the chart takes the URL from a Secret for it) as `***`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


@dataclass
class RedisLimiter:
    url: str
    fallback: LocalLimiter = field(default_factory=LocalLimiter)
    timeout_s: float = 1.0  # a Redis on the cluster network answers in ~1 ms; past 1 s it is gone
    _down: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.client: Any = aioredis.Redis.from_url(
            self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )
        self._admit = self.client.register_script(ADMIT)
        self._settle = self.client.register_script(SETTLE)

    def _lost(self, error: RedisError) -> None:
        if not self._down:
            logger.warning(
                "event=redis_unreachable url=%s error=%r fallback=local_buckets", redacted(self.url), error
            )
        self._down = True

    async def admit(self, tenant: Tenant, tokens: int) -> tuple[Verdict, object]:
        if tenant.tpm and tokens > tenant.tpm:  # could never fit: no need to ask Redis
            return self.fallback.check(tenant, tokens), None
        window_ms = int(WINDOW_S * 1000)
        try:
            allowed, r, t, ttl, w = await self._admit(
                keys=[key_of(tenant)], args=[tenant.rpm, tenant.tpm, tokens, window_ms, uuid.uuid4().hex]
            )
        except RedisError as error:
            self._lost(error)
            return self.fallback.check(tenant, tokens), None
        if self._down:
            logger.info("event=redis_reachable url=%s", redacted(self.url))
            self._down = False
        reset_s = int(ttl) / 1000
        full_r = tenant.rpm and int(r) + 1 > tenant.rpm
        full_t = tenant.tpm and int(t) + tokens > tenant.tpm
        verdict = Verdict(
            bool(allowed),
            tenant.rpm,
            tenant.tpm,
            tenant.rpm - int(r),
            tenant.tpm - int(t),
            reset_s,
            reset_s,
            # refused: the window's end frees the whole limit again
            reset_s if not allowed and (full_r or full_t) else 0.0,
        )
        return verdict, (w.decode() if isinstance(w, bytes) else w) if allowed else None

    async def settle(self, tenant: Tenant, ticket: object, delta_tokens: int) -> None:
        if ticket is None:  # admitted by the fallback
            await self.fallback.settle(tenant, None, delta_tokens)
            return
        if not delta_tokens:
            return
        try:
            await self._settle(keys=[key_of(tenant)], args=[str(ticket), math.trunc(delta_tokens)])
        except RedisError as error:
            self._lost(error)

    async def close(self) -> None:
        await self.client.aclose()
