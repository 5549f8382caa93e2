"""The gateway's tenant flags, and the gate built from them (`specfleet router --gateway`, `specfleet up`).

- `--tenants FILE`: the tenants of a YAML file (tenants.parse_tenants), read again every
  --discovery-interval (tenant_discovery.TenantsFile);
- `--tenant-selector SEL`: in the cluster, the tenants of the Secrets matching SEL in `--tenant-namespace`
  (default: the gateway's own namespace), read again every --discovery-interval;
- `--redis-url URL`: exact limits shared by every replica (redis_limits.py); without it each replica keeps
  buckets of its own, sized by `--replicas N`, or by the ready addresses of `--replica-service NAME` (the
  gateway's own Service, in its namespace) when given.
With neither --tenants nor --tenant-selector the gateway is open to anonymous callers, as before.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from .discovery import SERVICE_ACCOUNT, EndpointSliceWatch
from .quota import Limiter, LocalLimiter
from .tenant_discovery import SecretTenants, TenantsFile, replica_counter
from .tenant_gate import TenantGate
from .tenants import TenantTable, parse_tenants

# The Redis URL from the environment: the chart sets it from a Secret when the URL holds a password.
REDIS_URL_ENV = "SPECFLEET_REDIS_URL"


def add_tenant_flags(p: argparse.ArgumentParser, cluster: bool = True) -> None:
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="API keys, allowed models, quotas and priority classes of the gateway's tenants, from this YAML "
        "file (docs/router.md, 'Tenants'), read again every --discovery-interval; without it (or "
        "--tenant-selector) the gateway takes anonymous calls",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV) or None,
        help="keep the tenants' request and token counts in this Redis (redis://host:6379/0): exact limits "
        f"across gateway replicas (default: ${REDIS_URL_ENV}); without it each replica keeps its own "
        "buckets, each limit / --replicas",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="gateway replicas sharing the load: each one's buckets hold 1/N of every limit",
    )
    if not cluster:
        return
    p.add_argument(
        "--tenant-selector",
        default=None,
        help="in-cluster: the tenants are the Secrets matching this label selector "
        "(e.g. specfleet.dev/tenant=true) in --tenant-namespace",
    )
    p.add_argument(
        "--tenant-namespace", default=None, help="the tenants' Secrets' namespace (default: the pod's own)"
    )
    p.add_argument(
        "--replica-service",
        default=None,
        help="in-cluster: the gateway's own Service; its ready addresses are the replica count (over --replicas)",
    )


def build_gate(args: argparse.Namespace) -> tuple[TenantGate | None, list[Coroutine[Any, Any, None]]]:
    """The gate the flags ask for (None: no tenants) and what must run beside it (Secrets, replicas)."""
    selector = getattr(args, "tenant_selector", None)
    if args.tenants and selector:
        raise ValueError("--tenants and --tenant-selector exclude each other: give the tenants one way")
    if args.replicas < 1:
        raise ValueError(f"--replicas={args.replicas} must be >= 1")
    if not args.tenants and not selector:
        if args.redis_url:
            raise ValueError("--redis-url needs tenants (--tenants or --tenant-selector) to count for")
        return None, []
    text = Path(args.tenants).read_text() if args.tenants else None
    table = TenantTable(parse_tenants(text, args.tenants) if text is not None else [])
    local = LocalLimiter(replicas=args.replicas)
    limiter: Limiter = local
    if args.redis_url:
        from .redis_limits import RedisLimiter

        limiter = RedisLimiter(args.redis_url, fallback=local)
    jobs: list[Coroutine[Any, Any, None]] = []
    replica_service = getattr(args, "replica_service", None)
    own = Path(SERVICE_ACCOUNT / "namespace").read_text().strip() if selector or replica_service else ""
    interval = getattr(args, "discovery_interval", 5.0)
    if text is not None:  # an edit applies within one interval: a key taken out stops working
        seen = hashlib.sha256(text.encode()).digest()
        jobs.append(TenantsFile(table, Path(args.tenants), interval, seen).run())
    if selector:
        namespace = str(args.tenant_namespace or own)
        jobs.append(SecretTenants.in_cluster(table, namespace, selector=selector, interval_s=interval).run())
    if replica_service:
        jobs.append(EndpointSliceWatch.in_cluster(own, replica_service, replica_counter(local)).run())
    return TenantGate(table, limiter), jobs
