"""The operator's own metrics (operator/metrics.py), which the InferenceService alerts read instead of a
kube-state-metrics custom-resource config: the real kopf operator against the fake API server (HTTP),
its /metrics served by prometheus-client over a real socket and scraped by a real Prometheus, queried
with the alert rules' own expressions."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml
from fake_kube import FakeKube
from helpers import free_port, wait_for
from isvc_schema_tools import REPO
from rollouts import report_router_rolled_out

NS = "team-a"  # the namespace the API double grants the chart's RBAC in (conftest.py)
NAME = "metered"  # not a name other tests leave series for in this process's registry
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
DEPLOY = ("/apis/apps/v1", "deployments")
RULES = REPO / "deploy" / "monitoring" / "prometheus-rules.yaml"


@pytest.fixture(scope="module")
def metrics_url() -> str:
    from specfleet.operator import metrics

    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    return f"http://127.0.0.1:{port}"


def series(url: str, name: str) -> dict[str, float]:
    """`{labels}` -> value of every sample of `name` on the operator's /metrics, for service NAME."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
        if f'namespace="{NS}"' in m.group(1) and f'service="{NAME}"' in m.group(1)
    }


def alert_expr(name: str) -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return next(r["expr"] for g in groups for r in g["rules"] if r.get("alert") == name)


def query(prom: str, promql: str) -> list[dict]:
    body = httpx.get(f"{prom}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_conditions_and_generations_follow_the_reconcile_and_go_with_the_service(
    fake_kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metrics_url: str, prometheus_factory
) -> None:
    from kopf.testing import KopfRunner

    monkeypatch.setenv("KUBECONFIG", str(fake_kube.write_kubeconfig(tmp_path / "kubeconfig", NS)))
    monkeypatch.setenv("SPECFLEET_RECONCILE_INTERVAL", "1")
    fake_kube.add_namespace(NS)
    prom = prometheus_factory("specfleet-operator", [metrics_url])
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["metadata"]["name"] = NAME
    fake_kube.put(*ISVC, NS, doc)

    def ready() -> set[str]:
        return {
            labels
            for labels, value in series(metrics_url, "specfleet_inferenceservice_condition").items()
            if 'type="Ready"' in labels and value == 1
        }

    args = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        wait_for("Ready=Unknown as a series", lambda: any('status="Unknown"' in s for s in ready()))
        key = f'namespace="{NS}",service="{NAME}"'
        assert series(metrics_url, "specfleet_inferenceservice_generation") == {key: 1.0}
        # no status describes generation 1 until the Deployment controller has seen the rollout
        assert series(metrics_url, "specfleet_inferenceservice_observed_generation") == {key: 0.0}

        deployment = fake_kube.get(*DEPLOY, NS, NAME)
        deployment["status"] = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
            "availableReplicas": 1,
        }
        fake_kube.put(*DEPLOY, NS, deployment)
        wait_for("the router Deployment", lambda: fake_kube.get(*DEPLOY, NS, f"{NAME}-router"))
        report_router_rolled_out(fake_kube, NS, NAME)
        wait_for(
            "Ready=True as the only Ready series",
            lambda: len(ready()) == 1 and 'status="True"' in next(iter(ready())),
        )
        assert series(metrics_url, "specfleet_inferenceservice_observed_generation") == {key: 1.0}

        # the alert rules' own expressions, on what a real Prometheus scraped from the operator
        wait_for(
            "the operator's series in Prometheus",
            lambda: query(
                prom, f'specfleet_inferenceservice_condition{{namespace="{NS}", type="Ready", status="True"}}'
            ),
            timeout=30,
        )
        # (the registry is the process's: other tests' services may be in it, so look at this one only)
        for alert in ("SpecfleetOperatorNotReconciling", "SpecfleetInferenceServiceDegraded"):
            assert [
                r
                for r in query(prom, alert_expr(alert))
                if (r["metric"]["namespace"], r["metric"]["service"]) == (NS, NAME)
            ] == [], alert

        fake_kube.remove(*ISVC, NS, NAME)
        wait_for(
            "the deleted service's series gone",
            lambda: not series(metrics_url, "specfleet_inferenceservice_generation") and not ready(),
        )
    assert runner.exception is None, runner.output


@pytest.mark.slow
def test_a_reconcile_that_keeps_failing_shows_generation_ahead(
    fake_kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metrics_url: str
) -> None:
    """The API server errs on every Deployment write (503): the operator sees generation 2 but never writes
    a status for it, which SpecfleetOperatorNotReconciling reads. (A child the API server refuses with a
    4xx is reported as Degraded instead, with the generation observed.)"""
    from kopf.testing import KopfRunner

    monkeypatch.setenv("KUBECONFIG", str(fake_kube.write_kubeconfig(tmp_path / "kubeconfig", NS)))
    monkeypatch.setenv("SPECFLEET_RECONCILE_INTERVAL", "1")
    fake_kube.add_namespace(NS)
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["metadata"]["name"] = NAME
    fake_kube.put(*ISVC, NS, doc)
    key = f'namespace="{NS}",service="{NAME}"'
    with KopfRunner(
        ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"], timeout=60
    ):
        deployment = wait_for("the Deployment", lambda: fake_kube.get(*DEPLOY, NS, NAME))
        deployment["status"] = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
            "availableReplicas": 1,
        }
        fake_kube.put(*DEPLOY, NS, deployment)
        wait_for("the router Deployment", lambda: fake_kube.get(*DEPLOY, NS, f"{NAME}-router"))
        report_router_rolled_out(fake_kube, NS, NAME)
        wait_for(
            "generation 1 reconciled",
            lambda: series(metrics_url, "specfleet_inferenceservice_observed_generation").get(key) == 1.0,
        )
        for _ in range(1000):  # every write of the Deployment from now on
            fake_kube.fail_next("PATCH", "/deployments/", status=503)
        isvc = fake_kube.get(*ISVC, NS, NAME)
        isvc["spec"]["batching"]["maxNumSeqs"] = 8
        fake_kube.put(*ISVC, NS, isvc)
        wait_for(
            "generation 2 seen",
            lambda: series(metrics_url, "specfleet_inferenceservice_generation").get(key) == 2.0,
        )
        wait_for(
            "a few failed reconciles",
            lambda: (
                sum(1 for r in fake_kube.requests if r.method == "PATCH" and f"/deployments/{NAME}" in r.path)
                >= 4
            ),
            timeout=30,
        )
        assert series(metrics_url, "specfleet_inferenceservice_observed_generation")[key] == 1.0
        fake_kube.remove(*ISVC, NS, NAME)


def test_metrics_port_is_checked_before_the_operator_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from specfleet.operator.cli import main

    assert main(["-n", "a", "--metrics-port", "70000"]) == 2
    assert "--metrics-port 70000 is not a TCP port" in capsys.readouterr().out
    assert main(["-n", "a", "--metrics-port", "8080", "--liveness-port", "8080"]) == 2
    assert "use two ports" in capsys.readouterr().out
