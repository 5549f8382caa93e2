"""The chart's `gateway.tenants`: the gateway's flags for tenants from Secrets, rendered by Helm's own engine,
with RBAC on its own namespace's Secrets and EndpointSlices only when tenants are on; the gateway's Secret
reading and its replica count run against the API double holding exactly those grants."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from fake_kube import FakeKube, Rbac
from isvc_schema_tools import k8s_validate
from specfleet.router.discovery import EndpointSliceWatch
from specfleet.router.quota import LocalLimiter
from specfleet.router.tenant_discovery import SecretTenants, replica_counter
from specfleet.router.tenants import PRIORITY_CLASSES, TenantTable
from test_op_chart_gateway import NS, by_kind, gateway_objects, render

TENANTS = {
    "gateway": {"enabled": True, "tenants": {"enabled": True}},
    "watch": {"namespaces": ["team-a"]},
}
KEY = "sk-team-a-0123456789abcdef"


def secret(name: str, data: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS, "labels": labels or {"specfleet.dev/tenant": "true"}},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def endpoint_slice(ready: list[bool]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "sf-gateway-x",
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": "sf-gateway"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [
            {"addresses": [f"10.0.0.{i}"], "conditions": {"ready": r}} for i, r in enumerate(ready)
        ],
    }


def test_tenants_add_their_flags_and_a_role_on_the_release_namespace_only() -> None:
    objects, _ = render(TENANTS)
    mine = gateway_objects(objects) + [o for o in objects if o["metadata"]["name"] == "sf-gateway-tenants"]
    for obj in mine:
        k8s_validate(obj)
    (deployment,) = by_kind(mine, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"--tenant-selector=specfleet.dev/tenant=true", "--replica-service=sf-gateway"} <= set(
        container["args"]
    )
    assert not any(a.startswith("--redis-url") for a in container["args"]) and "env" not in container
    rbac = Rbac.from_objects(objects, "sf-gateway", NS)
    assert rbac.allows("list", "", "secrets", NS) and rbac.allows(
        "list", "discovery.k8s.io", "endpointslices", NS
    )
    assert not rbac.allows("list", "", "secrets", "team-a") and not rbac.allows("create", "", "secrets", NS)

    with_url, _ = render(
        {
            **TENANTS,
            "gateway": {"enabled": True, "tenants": {"enabled": True, "redisUrl": "redis://r:6379/0"}},
        }
    )
    (deployment,) = by_kind(gateway_objects(with_url), "Deployment")
    assert "--redis-url=redis://r:6379/0" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    from_secret, _ = render(
        {
            **TENANTS,
            "gateway": {
                "enabled": True,
                "tenants": {"enabled": True, "redisUrlSecret": {"name": "redis", "key": "url"}},
            },
        }
    )
    (deployment,) = by_kind(gateway_objects(from_secret), "Deployment")
    (env,) = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == {
        "name": "SPECFLEET_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "redis", "key": "url"}},
    }


def test_no_secret_access_without_tenants() -> None:
    objects, _ = render({"gateway": {"enabled": True}, "watch": {"namespaces": ["team-a"]}})
    assert not Rbac.from_objects(objects, "sf-gateway", NS).allows("list", "", "secrets", NS)
    with pytest.raises(Exception, match="redisUrl"):
        render({"gateway": {"enabled": True, "tenants": {"redisUrl": "http://not-redis"}}})


def test_the_gateway_reads_its_tenants_and_replicas_with_the_charts_grants() -> None:
    objects, _ = render(TENANTS)
    kube = FakeKube(rbac=Rbac.from_objects(objects, "sf-gateway", NS)).start()
    try:
        kube.add_namespace(NS)
        kube.put(
            "/api/v1",
            "secrets",
            NS,
            secret("team-a", {"key": KEY, "models": "alpha, beta", "rpm": "60", "priority": "interactive"}),
        )
        kube.put(
            "/api/v1", "secrets", NS, secret("broken", {"key": "sk-broken-0123456789abcdef", "rpm": "lots"})
        )
        kube.put(
            "/api/v1", "secrets", NS, secret("other", {"password": "hunter2hunter2hunter2"}, {"app": "db"})
        )
        kube.put("/apis/discovery.k8s.io/v1", "endpointslices", NS, endpoint_slice([True, True, False]))

        async def test() -> tuple[TenantTable, LocalLimiter]:
            table, limiter = TenantTable(), LocalLimiter()
            applied = asyncio.Event()
            secrets = SecretTenants(table, kube.url, NS, interval_s=0.2, on_apply=applied.set)
            watch = EndpointSliceWatch(kube.url, NS, "sf-gateway", replica_counter(limiter), retry_s=0.1)
            tasks = [asyncio.create_task(secrets.run()), asyncio.create_task(watch.run())]
            try:
                await asyncio.wait_for(applied.wait(), 20)
                for _ in range(200):
                    if limiter.replicas != 1:
                        break
                    await asyncio.sleep(0.05)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return table, limiter

        table, limiter = asyncio.run(asyncio.wait_for(test(), timeout=30))
        assert table.names() == ["team-a"]  # the broken one left out, the unlabelled one never listed
        tenant = table.find(KEY)
        assert tenant is not None and tenant.models == {"alpha", "beta"} and tenant.rpm == 60
        assert tenant.priority == PRIORITY_CLASSES["interactive"]
        assert limiter.replicas == 2  # the ready addresses of its own Service
        assert not kube.answered(403), [(r.method, r.path) for r in kube.answered(403)]
    finally:
        kube.stop()
