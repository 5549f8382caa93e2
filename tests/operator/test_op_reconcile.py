"""The reconcile path against the Kubernetes API faked at its HTTP edge: end states, not call sequences."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import yaml
from fake_kube import FakeKube
from isvc_schema_tools import REPO
from rollouts import report_rollout, report_router_rolled_out
from specfleet.operator.config import OperatorConfig
from specfleet.operator.inference_service import parse_inference_service
from specfleet.operator.kube import KubeClient
from specfleet.operator.reconcile import Outcome, Reconciler
from specfleet.operator.render import read_admin_token, render_tuned_config
from specfleet.operator.resources import FIELD_MANAGER, TUNER_FIELD_MANAGER

NS = "team-a"
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
DEPLOY = ("/apis/apps/v1", "deployments")
SERVICE = ("/api/v1", "services")
SECRET = ("/api/v1", "secrets")
PDB = ("/apis/policy/v1", "poddisruptionbudgets")
CONFIGMAP = ("/api/v1", "configmaps")
CONFIG = OperatorConfig(engine_cpu_image="registry.example/engine:cpu")


def create_isvc(fake: FakeKube, admit: bool = True, **spec_changes: Any) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["spec"].update(spec_changes)
    return fake.put(*ISVC, NS, doc, admit=admit)


def update_spec(fake: FakeKube, **spec_changes: Any) -> None:
    doc = fake.get(*ISVC, NS, "smollm2")
    assert doc is not None
    doc = copy.deepcopy(doc)
    doc["spec"].update(spec_changes)
    fake.put(*ISVC, NS, doc)


def reconcile(fake: FakeKube, config: OperatorConfig = CONFIG) -> Outcome:
    """One pass, as the kopf handler runs it: reconcile, then server-side apply the reconcile's status."""

    async def run() -> Outcome:
        client = KubeClient(fake.url)
        try:
            body = await client.get(f"{ISVC[0]}/namespaces/{NS}/{ISVC[1]}/smollm2")
            assert body is not None
            outcome = await Reconciler(client, config).reconcile(body, now="2026-01-01T00:00:00Z")
            await client.apply_status(NS, "smollm2", outcome.status, FIELD_MANAGER)
            return outcome
        finally:
            await client.close()

    return asyncio.run(run())


def set_deployment_status(
    fake: FakeKube,
    ready: int,
    updated: int | None = None,
    replicas: int | None = None,
    synced: bool = True,
    router: bool = True,
    **extra: Any,
) -> None:
    """The engine Deployment's status as its controller reports it; with `router`, the router Deployment
    (when routing renders one) has finished its rollout, so the engines' state decides Ready."""
    report_rollout(fake, NS, "smollm2", ready, updated, replicas, synced, **extra)
    if router and fake.get(*DEPLOY, NS, "smollm2-router") is not None:
        report_router_rolled_out(fake, NS, "smollm2")


def conditions(fake: FakeKube) -> dict[str, tuple[str, str]]:
    isvc = fake.get(*ISVC, NS, "smollm2")
    assert isvc is not None
    return {c["type"]: (c["status"], c["reason"]) for c in isvc["status"]["conditions"]}


def test_new_service_creates_owned_children_and_reports_pending(fake_kube: FakeKube) -> None:
    isvc = create_isvc(fake_kube)
    outcome = reconcile(fake_kube)
    uid = isvc["metadata"]["uid"]
    for kind in (DEPLOY, SERVICE):
        child = fake_kube.get(*kind, NS, "smollm2")
        assert child is not None, kind
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["kind"], owner["controller"]) == (uid, "InferenceService", True)
    secret = fake_kube.get(*SECRET, NS, "smollm2-admin")
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == uid
    assert fake_kube.get(*PDB, NS, "smollm2") is None  # one replica
    assert conditions(fake_kube)["Ready"] == ("Unknown", "Pending")
    status = fake_kube.get(*ISVC, NS, "smollm2")["status"]
    assert status["endpoint"] == "http://smollm2.team-a.svc:8000/v1"
    assert "observedGeneration" not in status  # nothing known about this generation's rollout yet
    assert status["tuning"]["maxNumSeqs"] == 16
    assert {e.reason for e in outcome.events} == {"Created"}
    set_deployment_status(fake_kube, ready=1)
    reconcile(fake_kube)
    assert (
        fake_kube.get(*ISVC, NS, "smollm2")["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    )


def test_status_follows_deployment_readiness(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube, replicas=2)
    reconcile(fake_kube)
    set_deployment_status(fake_kube, ready=1)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("False", "ReplicasNotReady")
    assert conditions(fake_kube)["Progressing"] == ("True", "RollingOut")
    set_deployment_status(fake_kube, ready=2)
    outcome = reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(fake_kube)["Progressing"] == ("False", "RolloutComplete")
    assert conditions(fake_kube)["Degraded"] == ("False", "AsExpected")
    assert fake_kube.get(*ISVC, NS, "smollm2")["status"]["readyReplicas"] == 2
    assert "Ready" in {e.reason for e in outcome.events}
    set_deployment_status(
        fake_kube,
        ready=0,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "ReplicaSet has timed out progressing",
            }
        ],
    )
    outcome = reconcile(fake_kube)
    assert conditions(fake_kube)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert any(e.type == "Warning" for e in outcome.events)


def test_spec_change_updates_the_deployment_and_second_pass_is_a_no_op(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    before = fake_kube.get(*DEPLOY, NS, "smollm2")
    update_spec(fake_kube, batching={"maxNumSeqs": 32, "maxNumBatchedTokens": 1024}, replicas=3)
    outcome = reconcile(fake_kube)
    after = fake_kube.get(*DEPLOY, NS, "smollm2")
    assert before is not None and after is not None
    args = after["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "32" and after["spec"]["replicas"] == 3
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert "Updated" in {e.reason for e in outcome.events}
    assert fake_kube.get(*PDB, NS, "smollm2") is not None  # three replicas now
    again = fake_kube.get(*DEPLOY, NS, "smollm2")
    outcome = reconcile(fake_kube)
    assert (
        fake_kube.get(*DEPLOY, NS, "smollm2")["metadata"]["resourceVersion"]
        == again["metadata"]["resourceVersion"]
    )
    assert not {e.reason for e in outcome.events} & {"Created", "Updated"}
    update_spec(fake_kube, replicas=1)
    reconcile(fake_kube)
    assert fake_kube.get(*PDB, NS, "smollm2") is None


def test_a_tuning_change_rolls_nothing_and_autotune_off_removes_the_tuned_configmap(
    fake_kube: FakeKube,
) -> None:
    """The tuner's writes of `NAME-tuned` (as tuner/handlers.py applies it, with the chart's RBAC) leave the
    Deployment as it was: the template names the ConfigMap, it does not hold its values. Turning autotune
    off deletes it, so new pods start on the spec's values again."""
    create_isvc(fake_kube, autotune={"enabled": True})
    reconcile(fake_kube)
    before = fake_kube.get(*DEPLOY, NS, "smollm2")
    assert (
        before is not None and fake_kube.get(*CONFIGMAP, NS, "smollm2-tuned") is None
    )  # the tuner's to write

    async def tuner_writes(values: dict[str, int]) -> None:
        client = KubeClient(fake_kube.url)
        try:
            body = await client.get(f"{ISVC[0]}/namespaces/{NS}/{ISVC[1]}/smollm2")
            assert body is not None
            await client.apply(
                render_tuned_config(parse_inference_service(body, "smollm2"), values), TUNER_FIELD_MANAGER
            )
        finally:
            await client.close()

    for seqs in (8, 12):
        asyncio.run(tuner_writes({"max_num_seqs": seqs, "num_speculative_tokens": 0}))
        outcome = reconcile(fake_kube)
        after = fake_kube.get(*DEPLOY, NS, "smollm2")
        assert after is not None and after["metadata"]["generation"] == before["metadata"]["generation"]
        assert after["spec"]["template"] == before["spec"]["template"]
        assert not {e.reason for e in outcome.events} & {"Updated", "Deleted"}
    configmap = fake_kube.get(*CONFIGMAP, NS, "smollm2-tuned")
    assert configmap is not None and '"max_num_seqs": 12' in next(iter(configmap["data"].values()))
    assert (
        configmap["metadata"]["ownerReferences"][0]["uid"] == before["metadata"]["ownerReferences"][0]["uid"]
    )
    update_spec(fake_kube, autotune={"enabled": False})
    outcome = reconcile(fake_kube)
    assert fake_kube.get(*CONFIGMAP, NS, "smollm2-tuned") is None
    assert any(e.reason == "Deleted" and "ConfigMap smollm2-tuned" in e.message for e in outcome.events)


def test_deleted_children_are_recreated_and_the_token_survives(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    token = read_admin_token(fake_kube.get(*SECRET, NS, "smollm2-admin"))
    fake_kube.remove(*DEPLOY, NS, "smollm2")
    fake_kube.remove(*SERVICE, NS, "smollm2")
    reconcile(fake_kube)
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is not None
    assert fake_kube.get(*SERVICE, NS, "smollm2") is not None
    reconcile(fake_kube)
    assert read_admin_token(fake_kube.get(*SECRET, NS, "smollm2-admin")) == token


def test_a_conflict_is_retried(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    fake_kube.fail_next("PATCH", "/deployments/smollm2", 409)
    fake_kube.fail_next("POST", "/secrets", 409)
    reconcile(fake_kube)
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is not None
    assert fake_kube.get(*SECRET, NS, "smollm2-admin") is not None


def test_the_operator_never_writes_spec(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    set_deployment_status(fake_kube, ready=1)
    update_spec(fake_kube, replicas=2)
    reconcile(fake_kube)
    isvc_writes = [
        r
        for r in fake_kube.requests
        if r.method in ("PUT", "PATCH", "POST") and "/inferenceservices" in r.path
    ]
    assert isvc_writes, "expected status writes"
    for request in isvc_writes:
        assert request.path.endswith("/status") or "spec" not in (request.body or {}), request


def test_invalid_spec_is_reported_not_rolled_out(fake_kube: FakeKube) -> None:
    create_isvc(
        fake_kube, admit=False, speculative={"method": "draft"}
    )  # an older CRD let it in; the operator must not
    outcome = reconcile(fake_kube)
    assert outcome.invalid and "draftModel" in outcome.invalid
    assert conditions(fake_kube)["Degraded"] == ("True", "InvalidSpec")
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is None
    assert [e.reason for e in outcome.events] == ["InvalidSpec"]
    assert reconcile(fake_kube).events == []  # the timer does not repeat the same warning


def test_disaggregation_stored_past_admission_without_the_router_is_reported_not_ignored(
    fake_kube: FakeKube,
) -> None:
    """Roles need the router: an object stored past the CEL rule is an invalid spec (the rule's pydantic
    twin), not engines that nothing sends through both halves."""
    create_isvc(
        fake_kube,
        admit=False,
        disaggregation={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        routing={"enabled": False},
    )
    outcome = reconcile(fake_kube)
    assert outcome.invalid and "needs routing.enabled" in outcome.invalid
    assert conditions(fake_kube)["Degraded"] == ("True", "InvalidSpec")
    assert fake_kube.get(*DEPLOY, NS, "smollm2-decode") is None


def test_router_children_follow_routing_enabled(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    uid = fake_kube.get(*ISVC, NS, "smollm2")["metadata"]["uid"]
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    router_objects = [
        (DEPLOY, "smollm2-router"),
        (PDB, "smollm2-router"),
        (SERVICE, "smollm2-engines"),
        (("/api/v1", "serviceaccounts"), "smollm2-router"),
        ((rbac, "roles"), "smollm2-router"),
        ((rbac, "rolebindings"), "smollm2-router"),
    ]
    for kind, name in router_objects:
        child = fake_kube.get(*kind, NS, name)
        assert child is not None and child["metadata"]["ownerReferences"][0]["uid"] == uid, (kind, name)
    service = fake_kube.get(*SERVICE, NS, "smollm2")
    assert service["spec"]["selector"] == {"serving.specfleet.io/router": "smollm2"}
    update_spec(fake_kube, routing={"enabled": False})
    outcome = reconcile(fake_kube)
    for kind, name in router_objects:
        assert fake_kube.get(*kind, NS, name) is None, (kind, name)
    service = fake_kube.get(*SERVICE, NS, "smollm2")
    assert service["spec"]["selector"] == {"serving.specfleet.io/inferenceservice": "smollm2"}
    assert sum(e.reason == "Deleted" for e in outcome.events) == 6
