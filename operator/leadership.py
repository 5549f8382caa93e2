"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go's and controller-runtime's managers do.

Every operator replica starts as a candidate. The one that holds the Lease runs kopf (every handler: the
reconcile, the tuner's timers, scale-from-zero); the others run no handler at all, not even a watch, and
only read the Lease every retry period, serving `/healthz` so that their liveness probe passes. The holder
renews the Lease every retry period; when it could not renew for the renew deadline (API server
unreachable, partitioned) it stops its handlers and exits, and Kubernetes restarts it as a candidate. On a
clean stop (SIGTERM: an upgrade, a node drain) it releases the Lease, so a candidate takes over at its next
look. A holder that died without releasing is replaced once the Lease has gone unrenewed for its duration,
measured on the candidate's own clock from the moment it last saw the record change (as client-go does: no
trust in the clocks of other machines).

kopf's own peering was the other option: it pauses a replica when a peer of *higher* priority is alive, but
replicas of one Deployment share one priority, and kopf then pauses all of them ("Pausing all operators,
including self"), so it cannot elect; it also needs CRDs of its own. A Lease is what `kubectl get lease`,
client-go and controller-runtime users already read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("specfleet.operator.leadership")

# client-go's JitterFactor: a candidate looks again after retry_period * (1 + up to 0.2), so that two
# candidates that started together do not keep colliding on the same write.
JITTER = 0.2


class LeadershipLost(Exception):
    """The Lease was not renewed within the renew deadline, or another candidate holds it now."""


@dataclass(frozen=True)
class LeaseTimings:
    """How long a Lease lasts, how long its holder keeps trying to renew it, and how often anyone looks.

    After a crash a candidate sees the holder's last renewal at its next look (up to one jittered retry
    period later), waits the lease duration from then, and takes the Lease at the look after that: at most
    lease_duration + 2 x 1.2 x retry_period = 12.8 s, then kopf starts (about 1 s), within the 15 s issue 34
    asks for; client-go's own defaults (15/10/2) would take up to 20 s. A shorter lease costs no extra API
    calls (the holder renews every retry period whatever the duration): it only gives the holder less time
    to ride out an unreachable API server before it steps down.
    """

    # The failover budget above: 8 + 4.8 s to take over a crashed holder, + kopf's start, < 15 s.
    lease_duration_s: float = 8.0
    # The holder stops its handlers 5 s after its last successful renewal: 3 s before any candidate may take
    # the Lease, more than the <1 s kopf needs to cancel its handlers, so two never write at once; and two
    # tries to renew (at +2 s and +4 s) before it gives up.
    renew_deadline_s: float = 5.0
    # client-go's default: a candidate reads the Lease every 2 s and the holder renews as often (one request
    # each, 0.5 requests/s per replica).
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        for flag, value in self.flags().items():
            if not value > 0:
                raise ValueError(f"{flag}={value} must be greater than 0 seconds")
        if not self.lease_duration_s > self.renew_deadline_s:
            raise ValueError(
                f"--leader-election-lease-duration={self.lease_duration_s} must be greater than "
                f"--leader-election-renew-deadline={self.renew_deadline_s}: the holder must step down "
                "before a candidate may take the Lease"
            )
        if not self.renew_deadline_s > self.retry_period_s * (1 + JITTER):
            raise ValueError(
                f"--leader-election-renew-deadline={self.renew_deadline_s} must be greater than "
                f"{1 + JITTER} x --leader-election-retry-period={self.retry_period_s}: the holder needs more "
                "than one try to renew before it gives up"
            )

    def flags(self) -> dict[str, float]:
        return {
            "--leader-election-lease-duration": self.lease_duration_s,
            "--leader-election-renew-deadline": self.renew_deadline_s,
            "--leader-election-retry-period": self.retry_period_s,
        }


@dataclass(frozen=True)
class LeaseRecord:
    """A Lease's spec: who holds it, for how long after `renew_time`, and since when."""

    holder: str
    duration_s: int
    acquire_time: str
    renew_time: str
    transitions: int

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            spec.get("holderIdentity") or "",
            int(spec.get("leaseDurationSeconds") or 0),
            spec.get("acquireTime") or "",
            spec.get("renewTime") or "",
            int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.duration_s,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


def micro_time(when: datetime.datetime | None = None) -> str:
    """Kubernetes' MicroTime: RFC 3339 with exactly six fractional digits (the API server refuses fewer)."""
    return (when or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Candidate:
    """The decisions of one replica, without I/O or a clock of its own: whether it may write itself into
    the Lease it just read (`now` is a monotonic time), and what to write."""

    def __init__(self, identity: str, timings: LeaseTimings) -> None:
        self.identity = identity
        self.timings = timings
        self.observed: LeaseRecord | None = None
        self.observed_at = 0.0

    def observe(self, record: LeaseRecord, now: float) -> None:
        if record != self.observed:
            self.observed, self.observed_at = record, now

    def may_take(self, now: float) -> bool:
        record = self.observed
        if record is None or not record.holder or record.holder == self.identity:
            return True
        return now - self.observed_at >= record.duration_s

    def holds(self) -> bool:
        return self.observed is not None and self.observed.holder == self.identity

    def next_record(self, wall: str) -> LeaseRecord:
        duration = max(1, math.ceil(self.timings.lease_duration_s))  # whole seconds, never shorter
        if self.holds():
            assert self.observed is not None
            return dataclasses.replace(self.observed, duration_s=duration, renew_time=wall)
        transitions = self.observed.transitions + 1 if self.observed is not None else 0
        return LeaseRecord(self.identity, duration, wall, wall, transitions)


def default_identity() -> str:
    """The pod's name (its hostname) and a random suffix, so that a restarted container is a new holder."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class LeaseElector:
    """One candidate's reads and writes of the Lease `namespace/name` (GET, create, replace with the
    resourceVersion it read: a 409 means another candidate wrote first)."""

    def __init__(
        self,
        connect: Callable[[], Any],
        namespace: str,
        name: str,
        identity: str,
        timings: LeaseTimings,
    ) -> None:
        self._connect = connect  # -> kopf.ConnectionInfo (the operator's login: service account, kubeconfig)
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.namespace, self.name = namespace, name
        self.candidate = Candidate(identity, timings)
        self.timings = timings
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._ssl: Any = True
        self._lease: dict[str, Any] | None = None  # the Lease as this candidate last wrote it

    async def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        if self._session is None:
            info = self._connect()
            if info is None:
                raise ConnectionError("no Kubernetes credentials: no service account and no kubeconfig")
            self._server = info.server.rstrip("/")
            self._ssl = info.as_ssl_context() if info.server.startswith("https") else True
            timeout = aiohttp.ClientTimeout(total=self.timings.retry_period_s)
            self._session = aiohttp.ClientSession(timeout=timeout, headers=info.as_http_headers())
        async with self._session.request(method, self._server + path, json=body, ssl=self._ssl) as response:
            text = await response.text()
        if response.status == 401:  # a rotated token: log in again on the next try
            await self.close()
        try:
            return response.status, json.loads(text) if text else None
        except ValueError:  # a proxy's error page
            return response.status, {"message": text[:200]}

    async def try_acquire_or_renew(self, now: float) -> bool:
        """One attempt to hold the Lease (`now`: monotonic). The holder first writes its renewal over the
        Lease it last wrote (one request); otherwise, or when that write is refused, it reads the Lease and
        writes itself in when the candidate may. True when this candidate holds the Lease afterwards."""
        if self.candidate.holds() and self._lease is not None:
            renewal = {**self._lease, "spec": self.candidate.next_record(micro_time()).spec()}
            status, lease = await self._request("PUT", self.path, renewal)
            if status == 200:
                return self._seen(lease, now)
        status, lease = await self._request("GET", self.path)
        if status == 404:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self.candidate.next_record(micro_time()).spec(),
            }
            # 409: another candidate created it first
            status, lease = await self._request("POST", self.path.rsplit("/", 1)[0], body)
        elif status == 200:
            self.candidate.observe(LeaseRecord.from_lease(lease), now)
            if not self.candidate.may_take(now):
                return False
            lease = {**lease, "spec": self.candidate.next_record(micro_time()).spec()}
            status, lease = await self._request("PUT", self.path, lease)  # 409: another one wrote first
        if status not in (200, 201):
            # 409: another candidate wrote first, as expected; anything else (403: RBAC) is worth a warning
            level = logging.DEBUG if status == 409 else logging.WARNING
            message = (lease or {}).get("message", "") if isinstance(lease, dict) else ""
            log.log(level, "event=lease_refused lease=%s status=%s message=%s", self.path, status, message)
            return False
        return self._seen(lease, now)

    def _seen(self, lease: dict[str, Any], now: float) -> bool:
        self.candidate.observe(LeaseRecord.from_lease(lease), now)
        self._lease = lease
        return self.candidate.holds()

    async def acquire(self) -> None:
        """Return once this candidate holds the Lease."""
        while True:
            try:
                if await self.try_acquire_or_renew(time.monotonic()):
                    return
            except (aiohttp.ClientError, OSError, TimeoutError) as error:
                log.warning("event=lease_unreachable lease=%s error=%r", self.path, error)
            await asyncio.sleep(self.timings.retry_period_s * (1 + JITTER * random.random()))

    async def hold(self) -> None:
        """Renew every retry period; raise LeadershipLost when the renew deadline, counted from the last
        successful renewal, passes without another, or when another candidate holds the Lease."""
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while True:
            await asyncio.sleep(self.timings.retry_period_s)
            try:
                async with asyncio.timeout_at(renewed + self.timings.renew_deadline_s):
                    while not await self._renew_once():
                        await asyncio.sleep(self.timings.retry_period_s)
            except TimeoutError as error:
                raise LeadershipLost(
                    f"not renewed for {self.timings.renew_deadline_s:g} s (the renew deadline)"
                ) from error
            renewed = loop.time()

    async def _renew_once(self) -> bool:
        try:
            if await self.try_acquire_or_renew(time.monotonic()):
                return True
        except (aiohttp.ClientError, OSError, TimeoutError) as error:  # the request's own timeout too
            log.warning("event=lease_renew_failed lease=%s error=%r", self.path, error)
            return False
        holder = self.candidate.observed.holder if self.candidate.observed else ""
        if holder not in ("", self.candidate.identity):
            raise LeadershipLost(f"{holder} holds the Lease now")
        return False

    async def release(self) -> None:
        """Hand the Lease back (holder cleared, one second left) so that a candidate takes over at its next
        look instead of waiting out the lease duration; only if this candidate still holds it."""
        if not self.candidate.holds() or self._lease is None:
            return
        record = dataclasses.replace(self.candidate.next_record(micro_time()), holder="", duration_s=1)
        try:
            status, _ = await self._request("PUT", self.path, {**self._lease, "spec": record.spec()})
            log.info("event=lease_released lease=%s status=%s", self.path, status)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            log.warning("event=lease_release_failed lease=%s error=%r", self.path, error)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@contextlib.asynccontextmanager
async def standby_health(port: int | None) -> AsyncIterator[None]:
    """`/healthz` on the liveness port while this replica waits for the Lease (kopf serves it once it
    leads): a candidate is alive and ready, only not leading."""
    if port is None:
        yield
        return

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def run_elected(
    elector: LeaseElector, work: Callable[[], Coroutine[Any, Any, None]], liveness_port: int | None = None
) -> int:
    """Wait for the Lease, run `work` (kopf) while holding it. Returns 0 when `work` ended on its own (a
    SIGTERM kopf handled) and the Lease was released; 1 when leadership was lost and `work` was cancelled
    (the process exits and comes back as a candidate)."""
    async with standby_health(liveness_port):
        log.info("event=leader_election_wait identity=%s lease=%s", elector.candidate.identity, elector.path)
        await elector.acquire()
    record = elector.candidate.observed
    log.info(
        "event=leader_elected identity=%s lease=%s transitions=%s",
        elector.candidate.identity,
        elector.path,
        record.transitions if record else 0,
    )
    working = asyncio.create_task(work())
    holding = asyncio.create_task(elector.hold())
    try:
        await asyncio.wait({working, holding}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            log.error(
                "event=leader_lost identity=%s reason=%s", elector.candidate.identity, holding.exception()
            )
            working.cancel()
            # kopf cancels its handlers within this margin, before any candidate may take the Lease
            margin = elector.timings.lease_duration_s - elector.timings.renew_deadline_s
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(working, timeout=margin)
            return 1
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holding
        await elector.release()  # also when kopf itself failed: a candidate takes over at once
        working.result()
        return 0
    finally:
        for task in (working, holding):
            task.cancel()
        await elector.close()


def namespace_from_env() -> str | None:
    """The operator's own namespace, where the chart grants it the Lease (the chart sets POD_NAMESPACE)."""
    return os.environ.get("POD_NAMESPACE") or None
