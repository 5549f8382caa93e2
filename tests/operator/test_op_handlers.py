"""The real kopf operator (handlers + CLI wiring) against the fake API server over HTTP: end states."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fake_kube import FakeKube
from helpers import wait_for
from isvc_schema_tools import REPO
from rollouts import report_router_rolled_out
from specfleet.operator.cli import build_parser, main

NS = "team-a"
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
DEPLOY = ("/apis/apps/v1", "deployments")


def ready_status(fake: FakeKube) -> str | None:
    isvc = fake.get(*ISVC, NS, "smollm2") or {}
    conds = {c["type"]: c["status"] for c in (isvc.get("status") or {}).get("conditions", [])}
    return conds.get("Ready")


def args_of(fake: FakeKube) -> list[str]:
    deployment = fake.get(*DEPLOY, NS, "smollm2") or {}
    return (
        deployment.get("spec", {})
        .get("template", {})
        .get("spec", {})
        .get("containers", [{}])[0]
        .get("args", [])
    )


@pytest.fixture
def kubeconfig(fake_kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = fake_kube.write_kubeconfig(tmp_path / "kubeconfig", NS)
    monkeypatch.setenv("KUBECONFIG", str(path))
    fake_kube.add_namespace(NS)
    monkeypatch.setenv("SPECFLEET_RECONCILE_INTERVAL", "1")
    return path


def test_operator_converges_and_keeps_converging(fake_kube: FakeKube, kubeconfig: Path) -> None:
    from kopf.testing import KopfRunner

    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    fake_kube.put(*ISVC, NS, doc)
    args = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        wait_for("the Deployment", lambda: fake_kube.get(*DEPLOY, NS, "smollm2"))
        wait_for("Ready=Unknown on the first visit", lambda: ready_status(fake_kube) == "Unknown")

        deployment = fake_kube.get(*DEPLOY, NS, "smollm2")
        deployment["status"] = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
            "availableReplicas": 1,
        }
        fake_kube.put(*DEPLOY, NS, deployment)
        wait_for("the router Deployment", lambda: fake_kube.get(*DEPLOY, NS, "smollm2-router"))
        report_router_rolled_out(fake_kube, NS, "smollm2")
        wait_for("Ready=True after the pods are ready", lambda: ready_status(fake_kube) == "True")

        isvc = fake_kube.get(*ISVC, NS, "smollm2")
        isvc["spec"]["batching"]["maxNumSeqs"] = 8
        fake_kube.put(*ISVC, NS, isvc)
        wait_for(
            "the spec change in the Deployment",
            lambda: "8" == args_of(fake_kube)[args_of(fake_kube).index("--max-num-seqs") + 1],
        )

        fake_kube.remove(*DEPLOY, NS, "smollm2")
        wait_for("the deleted Deployment to come back", lambda: fake_kube.get(*DEPLOY, NS, "smollm2"))

    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    # kopf's timers hold no finalizer: with the operator gone (uninstalled, crash-looping) a deletion does not
    # hang, and the owner references garbage-collect every child.
    assert not fake_kube.get(*ISVC, NS, "smollm2")["metadata"].get("finalizers")
    fake_kube.remove(*ISVC, NS, "smollm2")
    assert fake_kube.get(*ISVC, NS, "smollm2") is None
    assert (
        fake_kube.get(*DEPLOY, NS, "smollm2") is None
        and fake_kube.get("/api/v1", "secrets", NS, "smollm2-admin") is None
    )
    assert not fake_kube.answered(403), [
        (r.method, r.path) for r in fake_kube.answered(403)
    ]  # the chart's RBAC suffices
    assert not fake_kube.answered(422), [(r.method, r.path) for r in fake_kube.answered(422)]
    writes = [
        r for r in fake_kube.requests if r.method in ("PUT", "PATCH") and "/inferenceservices/" in r.path
    ]
    assert writes and all(
        r.path.endswith("/status") or "spec" not in (r.body or {}) for r in writes if isinstance(r.body, dict)
    )
    assert all("/spec" not in op.get("path", "") for r in writes if isinstance(r.body, list) for op in r.body)
    events = [r.body for r in fake_kube.requests if r.method == "POST" and r.path.endswith("/events")]
    assert {"Created", "Ready"} <= {e.get("reason") for e in events}


def test_cli_requires_a_scope_and_parses_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "--all-namespaces" in capsys.readouterr().out
    args = build_parser().parse_args(["-n", "a", "-n", "b", "--liveness-port", "8080", "--standalone"])
    assert (args.namespace, args.liveness_port, args.standalone) == (["a", "b"], 8080, True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-n", "a", "--all-namespaces"])


def test_invalid_spec_is_reported_in_status_and_events(fake_kube: FakeKube, kubeconfig: Path) -> None:
    from kopf.testing import KopfRunner

    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["spec"]["speculative"] = {"method": "draft"}  # the CRD refuses this; an older CRD might not
    fake_kube.put(*ISVC, NS, doc, admit=False)

    def degraded() -> bool:
        isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
        conds = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions", [])}
        return conds.get("Degraded", {}).get("reason") == "InvalidSpec"

    with KopfRunner(
        ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"], timeout=60
    ):
        wait_for("Degraded=InvalidSpec", degraded)
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is None
    events = [r.body for r in fake_kube.requests if r.method == "POST" and r.path.endswith("/events")]
    assert any(e.get("reason") == "InvalidSpec" and "draftModel" in e.get("message", "") for e in events)


def test_operator_runs_prefill_and_decode_roles(fake_kube: FakeKube, kubeconfig: Path) -> None:
    """spec.disaggregation through the real kopf operator: a Deployment per role, Ready once both are."""
    from kopf.testing import KopfRunner

    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu-pd.yaml").read_text())
    doc["metadata"]["name"] = "smollm2"
    fake_kube.put(*ISVC, NS, doc)
    args = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        for role in ("prefill", "decode"):
            wait_for(
                f"the {role} Deployment", lambda role=role: fake_kube.get(*DEPLOY, NS, f"smollm2-{role}")
            )
        assert fake_kube.get(*DEPLOY, NS, "smollm2") is None
        for role, count in (("prefill", 1), ("decode", 2)):
            deployment = fake_kube.get(*DEPLOY, NS, f"smollm2-{role}")
            assert deployment is not None and deployment["spec"]["replicas"] == count
            deployment["status"] = {
                "observedGeneration": deployment["metadata"]["generation"],
                "replicas": count,
                "updatedReplicas": count,
                "readyReplicas": count,
                "availableReplicas": count,
            }
            fake_kube.put(*DEPLOY, NS, deployment)
        wait_for("the router Deployment", lambda: fake_kube.get(*DEPLOY, NS, "smollm2-router"))
        report_router_rolled_out(fake_kube, NS, "smollm2")
        wait_for("Ready=True once both roles are ready", lambda: ready_status(fake_kube) == "True")
    assert runner.exit_code == 0, runner.output
