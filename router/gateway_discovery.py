"""The gateway's services in the cluster: the InferenceServices it may serve, listed every interval, and
each one's engines from its EndpointSlices.

Every `interval_s` the gateway lists the InferenceServices in its namespaces (or in all) that match its
label selector, one LIST per namespace: a new service gets a `Router` of its own, built from its
`spec.routing` as the operator renders a service's router (policy, load factor, session header, queue
timeout, block size, the model source seeding the prefix hashes), and an EndpointSlice watch on its
engines' Service (router/discovery.py); a changed weight or alias applies at once, so the split follows a
weight change within one interval; a changed routing config rebuilds the router; a service that is gone
(deleted, or no longer selected) leaves the table and its watches stop.

The Services watched are the operator's (operator/resources.py; tests/router/test_gateway_discovery.py
checks the names against it): `NAME-engines` (headless) with the router enabled, `NAME-decode` and
`NAME-prefill` with spec.disaggregation, and the client Service `NAME` itself when routing is disabled
(it selects the engine pods then).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .discovery import SERVICE_ACCOUNT, EndpointSliceWatch, RoleStates, States
from .endpoints import EndpointSet
from .gateway import Gateway
from .policies import DEFAULT_POLICY, service_policy
from .prefix import BlockHasher, stable_hash
from .proxy import Router
from .weights import DEFAULT_WEIGHT

logger = logging.getLogger("specfleet.router.gateway")

# The InferenceService API (operator/resources.py GROUP, VERSION, PLURAL; the router may not import the
# operator: an import contract keeps it light).
ISVC_API = "/apis/serving.specfleet.io/v1alpha1"
ISVC_PLURAL = "inferenceservices"
# How often the gateway lists the InferenceServices: a weight change reaches the split within this; one
# LIST per namespace per interval is a small load on the API server next to the operator's own watches.
DEFAULT_INTERVAL_S = 5.0


def engine_services(name: str, spec: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The Services whose EndpointSlices hold an InferenceService's engines, each with the engines' role."""
    routing = spec.get("routing") or {}
    if spec.get("disaggregation") is not None:
        return [(f"{name}-decode", "decode"), (f"{name}-prefill", "prefill")]
    if routing.get("enabled", True):
        return [(f"{name}-engines", None)]
    return [(name, None)]


@dataclass(frozen=True)
class RouterConfig:
    """What a service's router is built from; a change rebuilds it (a weight or alias change does not)."""

    policy: str
    enabled: bool
    load_factor_percent: int
    session_header: str
    queue_timeout_s: float
    block_size: int
    source: str
    services: tuple[tuple[str, str | None], ...]

    @classmethod
    def of(cls, name: str, spec: dict[str, Any]) -> RouterConfig:
        routing = spec.get("routing") or {}
        return cls(
            str(routing.get("policy", DEFAULT_POLICY)),
            bool(routing.get("enabled", True)),
            int(routing.get("loadFactorPercent", 125)),
            str(routing.get("sessionHeader", "x-session-id")),
            float(routing.get("queueTimeoutSeconds", 0)),
            int((spec.get("engine") or {}).get("blockSize", 16)),
            str((spec.get("model") or {}).get("source", "")),
            tuple(engine_services(name, spec)),
        )

    def build(self, max_retries: int) -> Router:
        return Router(
            EndpointSet(),
            service_policy(self.policy, self.enabled, self.load_factor_percent),
            BlockHasher(self.block_size, None, stable_hash(self.source) if self.source else 0),
            self.session_header or None,
            max_retries,
            self.queue_timeout_s,
        )


@dataclass
class _Tracked:
    config: RouterConfig
    router: Router
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass
class InferenceServiceDiscovery:
    gateway: Gateway
    server: str
    namespaces: list[str] | None  # None: every namespace (a ClusterRole)
    selector: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    ssl_context: ssl.SSLContext | None = None
    port_name: str = "http"
    interval_s: float = DEFAULT_INTERVAL_S
    max_retries: int = 2
    retry_s: float = 2.0  # an EndpointSlice watch's wait after an error
    on_apply: Callable[[], None] | None = None  # after each list applied (tests wait on it)
    tracked: dict[str, _Tracked] = field(default_factory=dict)
    # the routers of services that left the table, each closing once its requests in flight are done
    closing: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    @classmethod
    def in_cluster(
        cls, gateway: Gateway, namespaces: list[str] | None, **kwargs: Any
    ) -> InferenceServiceDiscovery:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        return cls(
            gateway,
            f"https://{host}:{port}",
            namespaces,
            headers={"Authorization": f"Bearer {token}"},
            ssl_context=context,
            **kwargs,
        )

    @staticmethod
    def own_namespace() -> str:
        return Path(SERVICE_ACCOUNT / "namespace").read_text().strip()

    def _paths(self) -> list[str]:
        if self.namespaces is None:
            return [f"{ISVC_API}/{ISVC_PLURAL}"]
        return [f"{ISVC_API}/namespaces/{ns}/{ISVC_PLURAL}" for ns in self.namespaces]

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout) as session:
            try:
                while True:
                    try:
                        self.apply(await self._list(session))
                    except asyncio.CancelledError:
                        raise
                    except Exception as error:  # an API hiccup keeps the last known table
                        logger.warning(
                            "event=gateway_discovery_error error=%r retry_s=%.1f",
                            f"{type(error).__name__}: {error}",
                            self.interval_s,
                        )
                    await asyncio.sleep(self.interval_s)
            finally:  # the watches stop and the routers that left the table close now
                tasks = [t for tracked in self.tracked.values() for t in tracked.tasks] + list(self.closing)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _list(self, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        params = {"labelSelector": self.selector} if self.selector else {}
        for path in self._paths():
            async with session.get(
                self.server + path, params=params, ssl=self.ssl_context or True
            ) as response:
                if response.status != 200:
                    raise RuntimeError(f"listing {path} answered {response.status}: {await response.text()}")
                items += (await response.json()).get("items") or []
        return items

    def apply(self, items: list[dict[str, Any]]) -> None:
        """One list's worth of InferenceServices: the gateway's table becomes exactly these."""
        seen: set[str] = set()
        for isvc in items:
            meta = isvc.get("metadata") or {}
            name, namespace = meta.get("name"), meta.get("namespace", "")
            if not name or meta.get("deletionTimestamp"):
                continue
            key = f"{namespace}/{name}"
            spec = isvc.get("spec") or {}
            routing = spec.get("routing") or {}
            config = RouterConfig.of(name, spec)
            tracked = self.tracked.get(key)
            if tracked is None or tracked.config != config:
                if tracked is not None:
                    self._stop(key, tracked, "routing config changed")
                tracked = self._start(key, namespace, config)
            names = [name, *[str(a) for a in routing.get("aliases") or []]]
            self.gateway.upsert(key, names, int(routing.get("weight", DEFAULT_WEIGHT)), tracked.router)
            seen.add(key)
        for key in [k for k in self.tracked if k not in seen]:
            self._stop(key, self.tracked[key], "gone")
            self.gateway.remove(key)
        self.gateway.synced = True
        if self.on_apply is not None:
            self.on_apply()

    def _start(self, key: str, namespace: str, config: RouterConfig) -> _Tracked:
        router = config.build(self.max_retries)
        roles = RoleStates(router)
        tracked = _Tracked(config, router)
        for service, role in config.services:
            watch = EndpointSliceWatch(
                self.server,
                namespace,
                service,
                _logged(key, roles.watcher(role)),
                headers=self.headers,
                ssl_context=self.ssl_context,
                port_name=self.port_name,
                retry_s=self.retry_s,
            )
            tracked.tasks.append(asyncio.get_running_loop().create_task(watch.run()))
        self.tracked[key] = tracked
        logger.info("event=service_added service=%s engines=%s", key, ",".join(s for s, _ in config.services))
        return tracked

    def _stop(self, key: str, tracked: _Tracked, reason: str) -> None:
        for task in tracked.tasks:
            task.cancel()
        self.tracked.pop(key, None)
        tracked.tasks = []
        closing = asyncio.get_running_loop().create_task(_close_when_idle(tracked.router))
        self.closing.add(closing)
        closing.add_done_callback(self.closing.discard)
        logger.info("event=service_removed service=%s reason=%r", key, reason)


async def _close_when_idle(router: Router, poll_s: float = 1.0) -> None:
    """A router that left the table: its requests in flight (streams too) finish, then its connections close
    (at once when the gateway stops: cancelled, it closes them all the same)."""
    try:
        while router.in_flight:
            await asyncio.sleep(poll_s)
    finally:
        await router.close()


def _logged(key: str, on_change: Callable[[States], None]) -> Callable[[States], None]:
    def publish(states: States) -> None:
        on_change(states)
        logger.debug("event=engines service=%s ready=%d", key, sum(1 for r, _ in states.values() if r))

    return publish
