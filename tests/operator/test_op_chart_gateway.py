"""The chart's `gateway.enabled`: one `specfleet router --gateway` Deployment for the release, rendered by Helm's
own engine, with RBAC that lets it read InferenceServices and EndpointSlices in the watched namespaces and
nothing else; the gateway's discovery runs against the API double holding exactly those grants."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from fake_kube import FakeKube, Rbac
from isvc_schema_tools import REPO, k8s_validate
from specfleet.router.gateway import Gateway
from specfleet.router.gateway_discovery import ISVC_API, ISVC_PLURAL, InferenceServiceDiscovery

GATEWAY = {
    "gateway": {"enabled": True, "selector": "gateway=public"},
    "watch": {"namespaces": ["team-a", "team-b"]},
}
CLUSTER_WIDE = {"gateway": {"enabled": True}, "watch": {"allNamespaces": True}}
READ = ["get", "list", "watch"]
NS = "specfleet-system"
EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml").read_text())


def render(values: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
    with helm.Chart.load(REPO / "charts" / "specfleet") as chart:
        rendered = chart.render(values=values, name="sf", namespace=NS, is_install=True)
    notes = rendered.pop("specfleet/templates/NOTES.txt")
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc], notes


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def gateway_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["name"] == "sf-gateway"]


def test_no_gateway_unless_enabled() -> None:
    objects, _ = render(None)
    assert not gateway_objects(objects)


@pytest.mark.parametrize("values", [GATEWAY, CLUSTER_WIDE], ids=["namespaces", "cluster-wide"])
def test_gateway_renders_one_deployment_with_read_only_rbac(values: dict[str, Any]) -> None:
    objects, _ = render(values)
    mine = gateway_objects(objects)
    for obj in mine:
        k8s_validate(obj)
    (deployment,) = by_kind(mine, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "specfleet.router"]
    assert pod["serviceAccountName"] == "sf-gateway" and deployment["spec"]["replicas"] == 2
    (service,) = by_kind(mine, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    rules = [r for role in by_kind(mine, "Role") + by_kind(mine, "ClusterRole") for r in role["rules"]]
    assert rules and all(r["verbs"] == READ for r in rules)
    assert {(g, res) for r in rules for g in r["apiGroups"] for res in r["resources"]} == {
        ("serving.specfleet.io", "inferenceservices"),
        ("discovery.k8s.io", "endpointslices"),
    }
    if values is GATEWAY:
        assert {"--gateway", "--gateway-namespace=team-a", "--gateway-namespace=team-b"} <= set(
            container["args"]
        )
        assert "--selector=gateway=public" in container["args"]
        assert sorted(r["metadata"]["namespace"] for r in by_kind(mine, "Role")) == ["team-a", "team-b"]
        assert all(b["subjects"][0]["name"] == "sf-gateway" for b in by_kind(mine, "RoleBinding"))
    else:
        assert "--all-namespaces" in container["args"] and not by_kind(mine, "Role")


def test_the_gateways_grants_suffice_for_its_discovery_and_no_more() -> None:
    objects, _ = render(GATEWAY)
    rbac = Rbac.from_objects(objects, "sf-gateway", NS)
    assert not rbac.allows("list", "serving.specfleet.io", "inferenceservices", "team-c")
    assert not rbac.allows("patch", "serving.specfleet.io", "inferenceservices", "team-a")
    assert not rbac.allows("get", "", "secrets", "team-a")
    kube = FakeKube(rbac=rbac).start()
    try:
        for ns in ("team-a", "team-b"):
            kube.add_namespace(ns)
            doc = copy.deepcopy(EXAMPLE)
            doc["metadata"] = {"name": f"llm-{ns}", "namespace": ns, "labels": {"gateway": "public"}}
            kube.put(ISVC_API, ISVC_PLURAL, ns, doc)

        async def test() -> None:
            gateway = Gateway()
            discovery = InferenceServiceDiscovery(
                gateway, kube.url, ["team-a", "team-b"], "gateway=public", interval_s=0.2, retry_s=0.1
            )
            task = asyncio.create_task(discovery.run())
            try:
                for _ in range(200):
                    if gateway.synced:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # the EndpointSlice watches have listed at least once
            finally:
                task.cancel()
            assert sorted(gateway.models()) == ["llm-team-a", "llm-team-b"]

        asyncio.run(asyncio.wait_for(test(), timeout=30))
        assert not kube.answered(403), [(r.method, r.path) for r in kube.answered(403)]
        assert {r.path for r in kube.requests if "endpointslices" in r.path} == {
            "/apis/discovery.k8s.io/v1/namespaces/team-a/endpointslices",
            "/apis/discovery.k8s.io/v1/namespaces/team-b/endpointslices",
        }
    finally:
        kube.stop()
