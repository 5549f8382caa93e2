"""Where the gateway's tenants and its replica count come from: a file, or in the cluster Secrets.

`TenantsFile` reads the `--tenants` file again every interval: an edit applies within one interval (a key
taken out stops working), and an edit that does not parse is reported, naming the field, while the tenants
last read keep serving.

`SecretTenants` lists the Secrets of one namespace (the gateway's own, by default) that match a label
selector (`specfleet.dev/tenant=true` in the chart) every interval, as the gateway lists InferenceServices
(gateway_discovery.py): each Secret is one tenant (tenants.spec_from_secret_data reads its layout) and the
table becomes exactly the valid ones. An invalid Secret is logged with the field at fault and left out; the
others keep serving. Keys are hashed as they are read, and the Secrets' data is not kept.

`replica_counter` follows the EndpointSlices of the gateway's own Service: the ready addresses are the live
replicas, and the local buckets (quota.LocalLimiter) divide each limit by their number.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .discovery import SERVICE_ACCOUNT, States
from .quota import LocalLimiter
from .tenants import InvalidTenants, Tenant, TenantTable, parse_tenants, spec_from_secret_data

logger = logging.getLogger("specfleet.router.tenants")

TENANT_LABEL = "specfleet.dev/tenant"
DEFAULT_SELECTOR = f"{TENANT_LABEL}=true"


def tenant_of_secret(secret: dict[str, Any]) -> Tenant:
    meta = secret.get("metadata") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    data: dict[str, str] = {}
    for k, v in (secret.get("data") or {}).items():
        try:
            data[k] = base64.b64decode(v, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError, TypeError):
            raise InvalidTenants(f"Secret {name}: data.{k} is not base64 of UTF-8 text") from None
    for k, v in (secret.get("stringData") or {}).items():
        data.setdefault(k, str(v))
    return Tenant.of(spec_from_secret_data(data, str(meta.get("name", ""))))


def tenants_of_secrets(items: list[dict[str, Any]]) -> list[Tenant]:
    """The valid tenants of a list of Secrets, in name order; the invalid and the duplicates are logged."""
    tenants: list[Tenant] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    ordered = sorted(items, key=lambda s: (s.get("metadata") or {}).get("name", ""))
    for secret in ordered:
        where = (secret.get("metadata") or {}).get("name", "")
        try:
            tenant = tenant_of_secret(secret)
        except InvalidTenants as error:
            logger.warning("event=tenant_secret_invalid secret=%s error=%r", where, str(error))
            continue
        if tenant.name in names or digests.intersection(tenant.digests):
            logger.warning("event=tenant_secret_duplicate secret=%s tenant=%s", where, tenant.name)
            continue
        names.add(tenant.name)
        digests.update(tenant.digests)
        tenants.append(tenant)
    return tenants


@dataclass
class SecretTenants:
    table: TenantTable
    server: str
    namespace: str
    selector: str = DEFAULT_SELECTOR
    headers: dict[str, str] = field(default_factory=dict)
    ssl_context: ssl.SSLContext | None = None
    interval_s: float = 5.0
    on_apply: Callable[[], None] | None = None  # after each list applied (tests wait on it)

    @classmethod
    def in_cluster(cls, table: TenantTable, namespace: str, **kwargs: Any) -> SecretTenants:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        return cls(
            table,
            f"https://{host}:{port}",
            namespace,
            headers={"Authorization": f"Bearer {token}"},
            ssl_context=context,
            **kwargs,
        )

    async def run(self) -> None:
        path = f"{self.server}/api/v1/namespaces/{self.namespace}/secrets"
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout) as session:
            while True:
                try:
                    params = {"labelSelector": self.selector}
                    async with session.get(path, params=params, ssl=self.ssl_context or True) as response:
                        if response.status != 200:
                            raise RuntimeError(
                                f"listing Secrets answered {response.status}: {await response.text()}"
                            )
                        items = (await response.json()).get("items") or []
                    self.apply(items)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # an API hiccup keeps the tenants last read
                    logger.warning(
                        "event=tenant_discovery_error error=%r", f"{type(error).__name__}: {error}"
                    )
                await asyncio.sleep(self.interval_s)

    def apply(self, items: list[dict[str, Any]]) -> None:
        tenants = tenants_of_secrets(items)
        before = set(self.table.names())
        self.table.replace(tenants)
        if set(self.table.names()) != before:
            logger.info("event=tenants tenants=%s", ",".join(self.table.names()))
        if self.on_apply is not None:
            self.on_apply()


@dataclass
class TenantsFile:
    table: TenantTable
    path: Path
    interval_s: float = 5.0
    # sha256 of the text last applied or reported invalid (b"": unreadable): the text, keys and all, is not kept
    seen: bytes | None = None
    on_apply: Callable[[], None] | None = None  # after each read that changed the table (tests wait on it)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

    def check(self) -> None:
        """The file read again; applied when it changed and parses."""
        try:
            text = self.path.read_text()
        except OSError as error:
            if self.seen != b"":  # reported once, until it is back
                logger.warning("event=tenants_file_error file=%s error=%r", self.path, str(error))
            self.seen = b""
            return
        seen = hashlib.sha256(text.encode()).digest()
        if seen == self.seen:
            return
        self.seen = seen
        try:
            tenants = parse_tenants(text, str(self.path))
        except InvalidTenants as error:
            logger.warning("event=tenants_file_invalid keeping=last_valid error=%r", str(error))
            return
        self.table.replace(tenants)
        logger.info("event=tenants file=%s tenants=%s", self.path, ",".join(self.table.names()))
        if self.on_apply is not None:
            self.on_apply()


def replica_counter(limiter: LocalLimiter) -> Callable[[States], None]:
    """An EndpointSlice watch's callback (on the gateway's own Service) that sizes the local buckets by the
    ready addresses."""

    def on_change(states: States) -> None:
        ready = max(1, sum(1 for is_ready, _ in states.values() if is_ready))
        if ready != limiter.replicas:
            logger.info("event=gateway_replicas replicas=%d", ready)
        limiter.set_replicas(ready)

    return on_change
