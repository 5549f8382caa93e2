"""The Helm chart renders with a real Helm engine (Helm's Go library via helm-python-sdk), and what it
renders is valid Kubernetes with least-privilege RBAC."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml
from isvc_schema_tools import CRD_PATH, REPO, k8s_validate

CHART = REPO / "charts" / "specfleet"
NS = "specfleet-system"
NON_DEFAULT = {
    "image": {"repository": "registry.local/specfleet-operator", "tag": "dev"},
    "engine": {"image": "registry.local/engine:cuda", "cpuImage": "registry.local/engine:cpu"},
    "watch": {"namespaces": ["team-a", "team-b"]},
    "prometheusURL": "http://prometheus.monitoring:9090",
    "serviceMonitor": {"enabled": False},
    "verbose": True,
    "tolerations": [{"key": "infra", "operator": "Exists"}],
}
CLUSTER_WIDE = {"watch": {"allNamespaces": True}}


def render(values: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="sf", namespace=NS, is_install=True)
    notes = rendered.pop("specfleet/templates/NOTES.txt")
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    return objects, notes


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("values", [None, NON_DEFAULT, CLUSTER_WIDE], ids=["default", "custom", "cluster-wide"])
def test_chart_renders_valid_least_privilege_objects(values: dict[str, Any] | None) -> None:
    objects, notes = render(values)
    assert {o["kind"] for o in objects} >= {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    for obj in objects:
        k8s_validate(obj)
    for role in by_kind(objects, "Role") + by_kind(objects, "ClusterRole"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
            assert "secrets" not in rule["resources"] or not {"list", "watch", "delete"} & set(rule["verbs"]), rule
    assert "kubectl" in notes and "smollm2-cpu.yaml" in notes
    pod = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert operator_container(objects)["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsUser"] >= 10000  # clear of the node's own users (checkov CKV_K8S_40)
    assert operator_container(objects)["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_default_scope_is_the_release_namespace() -> None:
    objects, _ = render(None)
    args = operator_container(objects)["args"]
    assert f"--namespace={NS}" in args and "--all-namespaces" not in args and "--standalone" in args
    assert [r["metadata"]["namespace"] for r in by_kind(objects, "Role")] == [NS]
    (binding,) = by_kind(objects, "RoleBinding")
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": "sf-operator", "namespace": NS}


def test_custom_values_reach_the_operator() -> None:
    objects, _ = render(NON_DEFAULT)
    container = operator_container(objects)
    assert container["image"] == "registry.local/specfleet-operator:dev"
    assert {"--namespace=team-a", "--namespace=team-b", "--verbose"} <= set(container["args"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPECFLEET_ENGINE_IMAGE"] == "registry.local/engine:cuda"
    assert env["SPECFLEET_ENGINE_CPU_IMAGE"] == "registry.local/engine:cpu"
    assert env["SPECFLEET_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"
    assert sorted(r["metadata"]["namespace"] for r in by_kind(objects, "Role")) == ["team-a", "team-b"]
    groups = {g for role in by_kind(objects, "Role") for rule in role["rules"] for g in rule["apiGroups"]}
    assert "monitoring.coreos.com" not in groups
    assert by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["tolerations"] == NON_DEFAULT["tolerations"]


def test_cluster_wide_uses_a_cluster_role() -> None:
    objects, notes = render(CLUSTER_WIDE)
    assert "--all-namespaces" in operator_container(objects)["args"]
    assert not by_kind(objects, "Role")
    names = {r["metadata"]["name"] for r in by_kind(objects, "ClusterRole")}
    assert names == {"sf-operator", "sf-operator-discovery"}
    assert "all namespaces" in notes


def test_chart_ships_the_crd_and_lints_clean() -> None:
    with helm.Chart.load(CHART) as chart:
        (crd,) = chart.crds
        assert yaml.safe_load(crd["data"]) == yaml.safe_load(CRD_PATH.read_text())
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


def test_bad_values_fail_with_a_message() -> None:
    with pytest.raises(helm.HelmError, match="serviceAccount.name is required"):
        render({"serviceAccount": {"create": False}})


def test_values_schema_names_the_bad_value() -> None:
    with pytest.raises(helm.HelmError, match="livenessPort"):
        render({"livenessPort": 70000})
