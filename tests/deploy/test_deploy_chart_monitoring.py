"""The chart's monitoring values, rendered by Helm's own engine: the PrometheusRule (validated against the
Prometheus Operator's CRD) and the Grafana dashboard ConfigMap, off by default. The chart's files/ are
written from deploy/monitoring by `python -m specfleet.operator.generate` (tests/test_generated.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from crd_schema import crd_errors

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "specfleet"
MONITORING = REPO / "deploy" / "monitoring"
PROMETHEUS_RULE_CRD = REPO / "tests" / "fixtures" / "crds" / "prometheus-operator-prometheusrule.yaml"
NS = "specfleet-system"
ON = {
    "monitoring": {
        "prometheusRule": {
            "enabled": True,
            "requireCRD": False,
            "labels": {"release": "kube-prometheus-stack"},
        },
        "podMonitor": {"enabled": True, "requireCRD": False, "labels": {"release": "kube-prometheus-stack"}},
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "annotations": {"grafana_folder": "specfleet"},
        },
    }
}


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="sf", namespace=NS, is_install=True)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def kinds(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_monitoring_is_off_by_default() -> None:
    objects = render(None)
    assert kinds(objects, "PrometheusRule") == [] and kinds(objects, "ConfigMap") == []
    assert kinds(objects, "PodMonitor") == []
    assert (
        kinds(render({"monitoring": {"podMonitor": {"enabled": True}}}), "PodMonitor") == []
    )  # no CRD served


def test_pod_monitor_scrapes_the_operators_metrics_port_keeping_its_labels() -> None:
    """The PodMonitor selects the operator's pod and its `metrics` port, where `--metrics-port` serves;
    honorLabels keeps the series' own `namespace`/`service` (the InferenceService's, not the operator's).
    Checked against the rendered Deployment; the PodMonitor CRD itself is not vendored here."""
    objects = render(ON)
    (monitor,) = kinds(objects, "PodMonitor")
    (deployment,) = kinds(objects, "Deployment")
    pod = deployment["spec"]["template"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == NS
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True and endpoint["path"] == "/metrics"
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--metrics-port={ports[endpoint['port']]}" in container["args"]
    assert ports["metrics"] != ports["health"]


def test_prometheus_rule_waits_for_the_crd() -> None:
    """Enabled, but the (offline) cluster does not serve monitoring.coreos.com/v1: nothing rendered."""
    objects = render({"monitoring": {"prometheusRule": {"enabled": True}}})
    assert kinds(objects, "PrometheusRule") == []


def test_prometheus_rule_carries_the_rules_and_validates() -> None:
    (rule,) = kinds(render(ON), "PrometheusRule")
    assert rule["metadata"]["namespace"] == NS
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())
    assert crd_errors(PROMETHEUS_RULE_CRD, rule) == []
    annotations = [
        r["annotations"]["summary"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    ]
    assert all("{{ $labels." in a for a in annotations), "Helm must not expand Prometheus' templates"


def test_dashboard_configmap_for_the_grafana_sidecar() -> None:
    (cm,) = kinds(render(ON), "ConfigMap")
    kubernetes_validate.validate(cm, "1.30.0", strict=True)
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "specfleet"}
    (text,) = cm["data"].values()
    assert json.loads(text) == json.loads((MONITORING / "grafana-dashboard.json").read_text())


def test_chart_lints_clean_with_monitoring_on() -> None:
    report = helm.lint(str(CHART), ON, strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


def test_values_schema_rejects_a_bad_monitoring_value() -> None:
    with pytest.raises(helm.HelmError, match="enabled"):
        render({"monitoring": {"prometheusRule": {"enabled": "yes"}}})
    with pytest.raises(helm.HelmError, match="grafanadashboard"):  # a typo would silently leave it off
        render({"monitoring": {"grafanadashboard": {"enabled": True}}})
