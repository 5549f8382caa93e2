"""Status that GitOps tools and `kubectl wait` can trust (issue 15, section 2), against the strict API
double: condition owners, serialized reconciles, Ready = rollout complete, the Deployment watch, refused
children, the optional ServiceMonitor and the admin Secret conflict."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import kopf
import pytest
from fake_kube import FakeKube, Rbac
from rollouts import report_rollout
from specfleet.operator import handlers
from specfleet.operator.config import OperatorConfig
from specfleet.operator.kube import KubeClient
from specfleet.operator.reconcile import Reconciler
from specfleet.operator.registry import Registry
from specfleet.operator.resources import TUNER_FIELD_MANAGER
from test_op_reconcile import (
    CONFIG,
    DEPLOY,
    ISVC,
    NS,
    SECRET,
    conditions,
    create_isvc,
    reconcile,
    set_deployment_status,
    update_spec,
)

MONITOR = ("/apis/monitoring.coreos.com/v1", "servicemonitors")


def status(fake: FakeKube) -> dict[str, Any]:
    return (fake.get(*ISVC, NS, "smollm2") or {}).get("status") or {}


def tuner_writes(fake: FakeKube, reason: str) -> None:
    """The tuner's write, as its kopf timer does it: its share of status under its own field manager."""

    async def run() -> None:
        client = KubeClient(fake.url)
        try:
            await client.apply_status(
                NS,
                "smollm2",
                {
                    "tuning": {
                        "numSpeculativeTokens": 2,
                        "reason": reason,
                        "observed": {"acceptanceRate": None, "goodput": 1.5},
                    },  # None: not observed this time
                    "conditions": [
                        {"type": "Tuned", "status": "True", "reason": "Holding", "message": reason}
                    ],
                },
                TUNER_FIELD_MANAGER,
            )
        finally:
            await client.close()

    asyncio.run(run())


def test_the_reconcile_and_the_tuner_keep_each_others_conditions(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube, autotune={"enabled": True})
    reconcile(fake_kube)
    tuner_writes(fake_kube, "holding")
    set_deployment_status(fake_kube, ready=1)
    reconcile(fake_kube)  # built from a status snapshot taken before the tuner wrote; must not drop Tuned
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(fake_kube)["Tuned"] == ("True", "Holding")
    assert status(fake_kube)["tuning"]["reason"] == "holding"  # autotune on: the tuner's, untouched
    tuner_writes(fake_kube, "still holding")
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    owners = fake_kube.fields(*ISVC, NS, "smollm2")
    assert all("Tuned" not in f and "tuning" not in f for f in owners["specfleet-operator"])
    assert all(
        f.startswith((".status.tuning", ".status.conditions[type=Tuned]"))
        for f in owners[TUNER_FIELD_MANAGER]
    )


def test_autotune_off_the_reconcile_owns_tuning_and_gives_it_up_when_it_turns_on(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    assert status(fake_kube)["tuning"]["reason"] == "autotune is off: values from spec"
    update_spec(fake_kube, autotune={"enabled": True})
    reconcile(fake_kube)
    assert "tuning" not in status(fake_kube)  # no stale spec values shown as if tuned; the tuner fills it


def test_reconciles_of_one_object_never_overlap(fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    create_isvc(fake_kube)
    inside, overlaps = [0], [0]
    original = Reconciler.reconcile

    async def slow(self: Reconciler, body: Any, now: str) -> Any:
        inside[0] += 1
        overlaps[0] = max(overlaps[0], inside[0])
        await asyncio.sleep(0.05)
        try:
            return await original(self, body, now)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(Reconciler, "reconcile", slow)
    monkeypatch.setattr(kopf, "info", lambda *a, **k: None)

    async def run() -> None:
        memo = kopf.Memo(config=CONFIG, registry=Registry(KubeClient(fake_kube.url)))
        body = fake_kube.get(*ISVC, NS, "smollm2")
        try:
            await asyncio.gather(*(handlers.converge(body, memo, logging.getLogger("t")) for _ in range(3)))
        finally:
            await memo.registry.client.close()

    asyncio.run(run())
    assert overlaps[0] == 1


def test_ready_means_the_rollout_is_complete(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube, replicas=2)
    reconcile(fake_kube)
    set_deployment_status(fake_kube, ready=2)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    generation = fake_kube.get(*ISVC, NS, "smollm2")["metadata"]["generation"]
    assert status(fake_kube)["observedGeneration"] == generation

    update_spec(fake_kube, batching={"maxNumSeqs": 8, "maxNumBatchedTokens": 2048})
    reconcile(fake_kube)  # the Deployment has a new template; its controller has not seen it yet
    set_deployment_status(fake_kube, ready=2, synced=False)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("Unknown", "Pending")  # the old pods' readiness says nothing
    assert status(fake_kube)["observedGeneration"] == generation  # not stamped before it is known
    set_deployment_status(fake_kube, ready=3, updated=1, replicas=3)  # surge: one new pod, two old ones
    reconcile(fake_kube)
    assert status(fake_kube)["observedGeneration"] == generation + 1
    assert conditions(fake_kube)["Ready"] == ("False", "RollingOut")
    progressing = next(c for c in status(fake_kube)["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "True" and "1/2 pods updated" in progressing["message"]
    assert "2 old pod(s) left" in progressing["message"]
    set_deployment_status(fake_kube, ready=2, availableReplicas=1)  # all updated, one not yet available
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"][0] == "False"
    set_deployment_status(fake_kube, ready=2)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(fake_kube)["Progressing"] == ("False", "RolloutComplete")


def test_a_deployment_change_reaches_status_through_the_watch(
    fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler kopf calls for every event of an owned Deployment: status follows the pods within
    seconds, not at the next timer (which this test never runs)."""
    create_isvc(fake_kube)
    reconcile(fake_kube)
    set_deployment_status(fake_kube, ready=1)
    monkeypatch.setattr(kopf, "info", lambda *a, **k: None)

    async def run() -> None:
        memo = kopf.Memo(config=CONFIG, registry=Registry(KubeClient(fake_kube.url)))
        try:
            await handlers.deployment_changed(
                body=fake_kube.get(*DEPLOY, NS, "smollm2"), memo=memo, logger=logging.getLogger("t")
            )
        finally:
            await memo.registry.client.close()

    asyncio.run(run())
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    registered = [
        h
        for h in kopf.get_default_registry()._watching.get_all_handlers()
        if h.fn is handlers.deployment_changed
    ]
    assert registered and registered[0].labels == {"app.kubernetes.io/managed-by": "specfleet-operator"}


@pytest.mark.parametrize("code, reason", [(422, "ChildInvalid"), (403, "ChildForbidden")])
def test_a_refused_child_is_degraded_with_the_servers_message(
    fake_kube: FakeKube, code: int, reason: str
) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    update_spec(fake_kube, replicas=2)
    fake_kube.fail_next("PATCH", "/deployments/smollm2", code)
    reconcile(fake_kube)  # does not raise: the rest of status is written
    st = status(fake_kube)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", reason)
    assert f"answered {code}: injected failure" in degraded["message"]
    assert conditions(fake_kube)["Ready"] == ("False", reason)
    assert st["endpoint"] and st["observedGeneration"] == 2  # the outcome for generation 2 is known: refused
    reconcile(fake_kube)
    assert conditions(fake_kube)["Degraded"] == ("False", "AsExpected")  # converges once the server accepts


def _monitoring_fake(chart_values: dict[str, Any]) -> FakeKube:
    return FakeKube(
        with_monitoring=True, rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}, **chart_values})
    ).start()


def test_service_monitor_follows_the_charts_setting() -> None:
    fake = _monitoring_fake({"serviceMonitor": {"enabled": False}})
    try:
        create_isvc(fake)
        off = OperatorConfig(**{**CONFIG.__dict__, "service_monitor": False})
        reconcile(fake, off)
        assert fake.get(*MONITOR, NS, "smollm2") is None and not fake.answered(403)
        assert "Monitored" not in conditions(fake) and conditions(fake)["Ready"] == ("Unknown", "Pending")
        # an operator told the wrong setting: a condition, not a crash, and status is still written
        reconcile(fake, CONFIG)
        assert conditions(fake)["Monitored"] == ("False", "Forbidden")
        assert conditions(fake)["Degraded"] == ("False", "AsExpected") and status(fake)["endpoint"]
    finally:
        fake.stop()
    fake = _monitoring_fake({})
    try:
        create_isvc(fake)
        reconcile(fake, CONFIG)
        assert fake.get(*MONITOR, NS, "smollm2") is not None
        assert conditions(fake)["Monitored"] == ("True", "ServiceMonitorApplied")
    finally:
        fake.stop()


def test_no_prometheus_operator_is_a_condition(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Monitored"] == ("False", "PrometheusOperatorMissing")


def test_a_users_secret_of_the_same_name_is_never_adopted(fake_kube: FakeKube) -> None:
    mine = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": "smollm2-admin"},
        "data": {"token": base64.b64encode(b"the-users-own-secret").decode()},
    }
    fake_kube.put(*SECRET, NS, mine)
    create_isvc(fake_kube)
    outcome = reconcile(fake_kube)
    assert conditions(fake_kube)["Degraded"] == ("True", "AdminSecretConflict")
    assert conditions(fake_kube)["Ready"] == ("False", "AdminSecretConflict")
    message = next(c["message"] for c in status(fake_kube)["conditions"] if c["type"] == "Degraded")
    assert "Secret smollm2-admin already exists" in message and "app.kubernetes.io/managed-by" in message
    secret = fake_kube.get(*SECRET, NS, "smollm2-admin")
    assert secret is not None and "ownerReferences" not in secret["metadata"]  # untouched
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is None  # no pod mounts someone else's Secret
    assert any(e.type == "Warning" and e.reason == "AdminSecretConflict" for e in outcome.events)
    fake_kube.remove(*SECRET, NS, "smollm2-admin")
    reconcile(fake_kube)
    assert conditions(fake_kube)["Degraded"] == ("False", "AsExpected")
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is not None


def test_the_admin_api_has_its_own_port_which_the_service_does_not_expose() -> None:
    from isvc_schema_tools import k8s_validate
    from specfleet.engine.server.cli import build_parser
    from specfleet.operator import load_inference_service
    from specfleet.operator.render import render_deployment, render_service
    from specfleet.operator.resources import ADMIN_PORT, ENGINE_PORT
    from test_op_reconcile import REPO

    isvc = load_inference_service(REPO / "examples" / "smollm2-cpu.yaml")
    container = render_deployment(isvc, CONFIG)["spec"]["template"]["spec"]["containers"][0]
    parsed = build_parser().parse_args(container["args"])  # the engine's own parser reads the pod's flags
    assert (parsed.host, parsed.port, parsed.admin_port) == ("0.0.0.0", ENGINE_PORT, ADMIN_PORT)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {k: v for k, v in ports.items() if not k.startswith("kv-")} == {
        "http": ENGINE_PORT,
        "admin": ADMIN_PORT,
    }
    service = render_service(isvc)
    assert [p["port"] for p in service["spec"]["ports"]] == [ENGINE_PORT]
    k8s_validate(service)


def test_network_policy_admits_only_the_operator_to_the_admin_port() -> None:
    from fake_kube import _render_chart
    from isvc_schema_tools import k8s_validate
    from specfleet.operator.resources import ADMIN_PORT, ENGINE_PORT

    objects = _render_chart('{"networkPolicy": {"enabled": true}}', "sf", "specfleet-system")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    env = {
        e["name"]: e.get("value", "") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    env["POD_NAMESPACE"] = "specfleet-system"  # the downward API's value
    config = OperatorConfig.from_env(env)
    assert config.network_policy and not OperatorConfig.from_env({}).network_policy
    assert dict(config.operator_pod_labels) == deployment["spec"]["selector"]["matchLabels"]
    fake = FakeKube(
        rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}, "networkPolicy": {"enabled": True}})
    ).start()
    try:
        create_isvc(fake)
        reconcile(fake, OperatorConfig(**{**config.__dict__, "engine_cpu_image": CONFIG.engine_cpu_image}))
        policy = fake.get("/apis/networking.k8s.io/v1", "networkpolicies", NS, "smollm2")
        assert policy is not None and not fake.answered(403)
        k8s_validate({k: v for k, v in policy.items() if k != "status"} | {"metadata": {"name": "smollm2"}})
        # the third: the engines' KV events, for this service's router (routing.kvEvents, test_op_kv_events.py)
        api_rule, admin_rule, _events_rule = policy["spec"]["ingress"]
        assert api_rule == {"ports": [{"port": ENGINE_PORT, "protocol": "TCP"}]}
        (source,) = admin_rule["from"]
        assert admin_rule["ports"] == [{"port": ADMIN_PORT, "protocol": "TCP"}]
        assert source["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "specfleet-system"
        }
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert (
            source["podSelector"]["matchLabels"].items() <= pod_labels.items()
        )  # selects the operator's pods
    finally:
        fake.stop()
    with pytest.raises(ValueError, match="POD_NAMESPACE"):
        OperatorConfig.from_env({"SPECFLEET_NETWORK_POLICY": "true"})


def test_a_router_that_cannot_start_is_not_ready_and_then_degraded(fake_kube: FakeKube) -> None:
    """The router is in the data path: engines all ready behind router pods stuck in ImagePullBackOff (never
    ready) is a service that answers nobody, which Ready, Progressing and Degraded say."""
    create_isvc(fake_kube)
    reconcile(fake_kube)
    set_deployment_status(fake_kube, ready=1, router=False)
    report_rollout(fake_kube, NS, "smollm2-router", ready=0)  # 2 pods created, pulling fails
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("False", "ReplicasNotReady")
    ready = next(c for c in status(fake_kube)["conditions"] if c["type"] == "Ready")
    assert "Deployment smollm2-router: scaling to 2 replicas: 0/2 available" in ready["message"]
    assert conditions(fake_kube)["Progressing"] == ("True", "RollingOut")
    assert (status(fake_kube)["replicas"], status(fake_kube)["readyReplicas"]) == (1, 1)  # engines only

    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "smollm2-router-5d4" has timed out progressing.',
    }
    report_rollout(fake_kube, NS, "smollm2-router", ready=0, conditions=[deadline])
    reconcile(fake_kube)
    assert conditions(fake_kube)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert conditions(fake_kube)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    degraded = next(c for c in status(fake_kube)["conditions"] if c["type"] == "Degraded")
    assert "kubectl describe pods -l serving.specfleet.io/router=smollm2" in degraded["message"]

    report_rollout(fake_kube, NS, "smollm2-router")  # the pull secret arrived: both router pods ready
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(fake_kube)["Degraded"] == ("False", "AsExpected")


def test_a_router_rollout_is_progressing_and_routing_off_leaves_it_out(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    reconcile(fake_kube)
    set_deployment_status(fake_kube, ready=1)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    # an operator upgrade rolls the router: one surge pod of the new template, two old ones
    report_rollout(fake_kube, NS, "smollm2-router", ready=2, updated=1, replicas=3)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("False", "RollingOut")
    assert conditions(fake_kube)["Progressing"] == ("True", "RollingOut")
    update_spec(fake_kube, routing={"enabled": False})
    reconcile(fake_kube)
    assert fake_kube.get(*DEPLOY, NS, "smollm2-router") is None
    # without the router the engines stop publishing KV events (routing.kvEvents): their own rollout
    set_deployment_status(fake_kube, ready=1)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
