"""Endpoint discovery in the cluster: watch the engines' EndpointSlices, keep the router's set equal to them.

The operator gives the engines a headless Service; Kubernetes' EndpointSlice controller publishes one
address per pod with conditions `ready`, `serving` and `terminating`. An address is routable when it is
ready (an unset `ready` means ready, as the API documents) and not terminating; a terminating one is
draining: it finishes its requests and gets nothing new. The watch lists first, then watches from the
list's resourceVersion, and lists again after an error or a 410 Gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

logger = logging.getLogger("specfleet.router.discovery")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
States = dict[str, tuple[bool, bool]]  # url -> (ready, draining)


def slice_states(slice_: dict[str, Any], port_name: str, scheme: str = "http") -> States:
    """One EndpointSlice's addresses as url -> (ready, draining)."""
    ports = slice_.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None:
        return {}
    out: States = {}
    for endpoint in slice_.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        terminating = bool(conditions.get("terminating", False))
        ready = conditions.get("ready") is not False and not terminating
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            out[f"{scheme}://{host}:{port}"] = (ready, terminating)
    return out


class EndpointSliceWatch:
    """Lists and watches the EndpointSlices of one Service; calls `on_change` with the whole set."""

    def __init__(
        self,
        server: str,
        namespace: str,
        service: str,
        on_change: Callable[[States], None],
        *,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        port_name: str = "http",
        retry_s: float = 2.0,
    ) -> None:
        self.server = server.rstrip("/")
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.selector = f"{SERVICE_NAME_LABEL}={service}"
        self.on_change = on_change
        self.headers = headers or {}
        self.ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self.port_name = port_name
        self.retry_s = retry_s
        self.slices: dict[str, dict[str, Any]] = {}

    @classmethod
    def in_cluster(
        cls, namespace: str, service: str, on_change: Callable[[States], None], **kwargs: Any
    ) -> EndpointSliceWatch:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        return cls(
            f"https://{host}:{port}",
            namespace,
            service,
            on_change,
            headers={"Authorization": f"Bearer {token}"},
            ssl_context=context,
            **kwargs,
        )

    def _publish(self) -> None:
        merged: States = {}
        for slice_ in self.slices.values():
            for url, (ready, draining) in slice_states(slice_, self.port_name).items():
                old = merged.get(url)  # an address in two slices (during a rollover): ready if either says so
                merged[url] = (ready or (old is not None and old[0]), draining and (old is None or old[1]))
        self.on_change(merged)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout) as session:
            while True:
                try:
                    version = await self._list(session)
                    await self._watch(session, version)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # the router must outlive an API hiccup
                    logger.warning(
                        "event=discovery_error error=%r retry_s=%.1f",
                        f"{type(error).__name__}: {error}",
                        self.retry_s,
                    )
                await asyncio.sleep(self.retry_s)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        async with session.get(
            self.server + self.path, params={"labelSelector": self.selector}, ssl=self.ssl
        ) as response:
            if response.status != 200:
                raise RuntimeError(
                    f"listing EndpointSlices answered {response.status}: {await response.text()}"
                )
            body = await response.json()
        self.slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
        self._publish()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, session: aiohttp.ClientSession, version: str) -> None:
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
        }
        async with session.get(self.server + self.path, params=params, ssl=self.ssl) as response:
            if response.status != 200:
                raise RuntimeError(
                    f"watching EndpointSlices answered {response.status}: {await response.text()}"
                )
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old; list again
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                if kind == "BOOKMARK":
                    continue
                name = obj.get("metadata", {}).get("name", "")
                if kind == "DELETED":
                    self.slices.pop(name, None)
                else:
                    self.slices[name] = obj
                self._publish()


async def probe_forever(
    urls: list[str], on_change: Callable[[States], None], interval_s: float = 1.0
) -> None:
    """Static endpoints (`specfleet router --endpoint URL`): each engine's `/ready` decides; a 503 with
    reason `draining` marks it draining."""
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            states: States = {}
            for url in urls:
                try:
                    async with session.get(f"{url}/ready") as response:
                        body = await response.json(content_type=None) if response.status == 503 else {}
                        states[url] = (response.status == 200, (body or {}).get("reason") == "draining")
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    states[url] = (False, False)
            on_change(states)
            await asyncio.sleep(interval_s)
