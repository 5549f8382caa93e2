"""Every child the operator writes is watched (issue 34, section 3): the real kopf operator on the API double
holding the chart's RBAC. A hand-deleted Service, a hand-edited NetworkPolicy and a deleted tuned ConfigMap
come back within seconds, far inside the reconcile timer (30 s) and the resync period (1800 s); an
annotation another tool adds to a child makes no API write."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube, Rbac
from helpers import wait_for
from isvc_schema_tools import REPO
from kopf.testing import KopfRunner
from rollouts import report_rollout, report_router_rolled_out
from specfleet.operator import handlers
from specfleet.operator.config import OperatorConfig
from specfleet.operator.inference_service import parse_inference_service
from specfleet.operator.registry import ServiceMemory, digest, owned_shape
from specfleet.operator.render.tuned import render_tuned_config

NS = "team-a"
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
DEPLOY = ("/apis/apps/v1", "deployments")
SERVICE = ("/api/v1", "services")
CONFIGMAP = ("/api/v1", "configmaps")
POLICY = ("/apis/networking.k8s.io/v1", "networkpolicies")
ARGS = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]
# A repair is one watch event plus one reconcile (milliseconds here); 5 s leaves room for a loaded CI
# machine and is still 6x under the reconcile timer's 30 s, so only the watch can have done it.
REPAIR_SECONDS = 5.0
OPERATOR_LABELS = (("app.kubernetes.io/name", "specfleet-operator"),)


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    """The API double with the RBAC the chart grants with networkPolicy.enabled (the test's operator
    writes NetworkPolicies too)."""
    values = {"watch": {"namespaces": [NS]}, "networkPolicy": {"enabled": True}}
    server = FakeKube(rbac=Rbac.from_chart(values)).start()
    server.add_namespace(NS)
    yield server
    server.stop()


@pytest.fixture
def kubeconfig(fake_kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = fake_kube.write_kubeconfig(tmp_path / "kubeconfig", NS)
    monkeypatch.setenv("KUBECONFIG", str(path))
    config = OperatorConfig(
        network_policy=True, operator_namespace="specfleet-system", operator_pod_labels=OPERATOR_LABELS
    )
    monkeypatch.setattr(handlers, "CONFIG", config)  # the startup handler puts it on the memo
    return path


class Observed:
    """The child watch events the operator's memory handled, by (kind, name)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        observe = ServiceMemory.observe_child

        def counted(memory: ServiceMemory, key: tuple[str, str], obj: dict[str, Any], deleted: bool) -> bool:
            self.events.append(key)
            return observe(memory, key, obj, deleted)

        monkeypatch.setattr(ServiceMemory, "observe_child", counted)


def start(fake: FakeKube, autotune: bool = False) -> None:
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    if autotune:
        doc["spec"]["autotune"] = {"enabled": True}
    fake.put(*ISVC, NS, doc)


def settle(fake: FakeKube) -> None:
    """Every child applied and both rollouts done: the operator has nothing left to write."""
    wait_for("the router Deployment", lambda: fake.get(*DEPLOY, NS, "smollm2-router"))
    wait_for("the NetworkPolicy", lambda: fake.get(*POLICY, NS, "smollm2"))
    report_rollout(fake, NS, "smollm2")
    report_router_rolled_out(fake, NS, "smollm2")
    wait_for("Ready", lambda: _ready(fake) == "True")


def _ready(fake: FakeKube) -> str | None:
    conditions = ((fake.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == "Ready"), None)


def writes(fake: FakeKube, since: int) -> list[str]:
    return [f"{r.method} {r.path}" for r in fake.requests[since:] if r.method not in ("GET", "HEAD")]


def timed(what: str, check: Any) -> float:
    began = time.monotonic()
    wait_for(what, check, timeout=REPAIR_SECONDS, interval=0.05)
    return time.monotonic() - began


def test_a_hand_deleted_service_comes_back_within_seconds(fake_kube: FakeKube, kubeconfig: Path) -> None:
    start(fake_kube)
    with KopfRunner(ARGS, timeout=60) as runner:
        settle(fake_kube)
        original = fake_kube.get(*SERVICE, NS, "smollm2")
        assert original is not None
        fake_kube.remove(*SERVICE, NS, "smollm2")
        seconds = timed("the Service back", lambda: fake_kube.get(*SERVICE, NS, "smollm2"))
        back = fake_kube.get(*SERVICE, NS, "smollm2")
        assert back is not None and back["metadata"]["uid"] != original["metadata"]["uid"]
        assert back["spec"]["ports"] == original["spec"]["ports"]
    assert runner.exception is None, runner.output
    print(f"Service recreated {seconds:.2f} s after its deletion")


def test_a_hand_edited_network_policy_is_undone_and_an_annotation_makes_no_write(
    fake_kube: FakeKube, kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    observed = Observed(monkeypatch)
    start(fake_kube)
    with KopfRunner(ARGS, timeout=60) as runner:
        settle(fake_kube)
        rendered = fake_kube.get(*POLICY, NS, "smollm2")
        assert rendered is not None and rendered["spec"]["ingress"]

        # another tool annotates the policy and the Service: seen by the watch, nothing of ours changed
        handled, mark = len(observed.events), len(fake_kube.requests)
        for path in (POLICY, SERVICE):
            obj = fake_kube.get(*path, NS, "smollm2")
            assert obj is not None
            obj["metadata"].setdefault("annotations", {})["audit.example.com/seen"] = "yes"
            fake_kube.put(*path, NS, obj)
        wait_for(
            "both annotation events handled",
            lambda: {("NetworkPolicy", "smollm2"), ("Service", "smollm2")} <= set(observed.events[handled:]),
        )
        time.sleep(1.0)  # room for any reconcile those events would start
        assert writes(fake_kube, mark) == []

        # the watches ask the API server for the operator's children only
        listed = [r for r in fake_kube.requests if r.path.endswith(f"/namespaces/{NS}/networkpolicies")]
        assert listed and all(
            r.query.get("labelSelector") == "app.kubernetes.io/managed-by=specfleet-operator" for r in listed
        ), [r.query for r in listed]

        # someone opens the policy to everyone: undone at the event, with one write (its echo starts none)
        edited = len(fake_kube.requests)
        opened = fake_kube.get(*POLICY, NS, "smollm2")
        assert opened is not None
        opened["spec"]["ingress"] = [{}]
        fake_kube.put(*POLICY, NS, opened)
        seconds = timed(
            "the NetworkPolicy's rules restored",
            lambda: (
                (fake_kube.get(*POLICY, NS, "smollm2") or {}).get("spec", {}).get("ingress")
                == rendered["spec"]["ingress"]
            ),
        )
        time.sleep(1.0)  # room for a reconcile the restore's own event would start
        assert [w for w in writes(fake_kube, edited) if "networkpolicies" in w] == [
            f"PATCH /apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/smollm2"
        ]
        after = fake_kube.get(*POLICY, NS, "smollm2")
        assert after is not None and after["metadata"]["annotations"]["audit.example.com/seen"] == "yes"
    assert runner.exception is None, runner.output
    print(f"NetworkPolicy restored {seconds:.2f} s after the edit")


def test_a_deleted_tuned_configmap_comes_back_with_the_tuners_config(
    fake_kube: FakeKube, kubeconfig: Path
) -> None:
    start(fake_kube, autotune=True)
    with KopfRunner(ARGS, timeout=60) as runner:
        settle(fake_kube)
        isvc = fake_kube.get(*ISVC, NS, "smollm2")
        assert isvc is not None
        # what the tuner writes (tuner/handlers.py publish_in_force): the config the engines accepted
        configmap = render_tuned_config(parse_inference_service(isvc, f"{NS}/smollm2"), {"max_num_seqs": 24})
        data = configmap["data"]
        fake_kube.put(*CONFIGMAP, NS, configmap)
        time.sleep(0.5)  # the watch delivers it
        fake_kube.remove(*CONFIGMAP, NS, "smollm2-tuned")
        seconds = timed("the tuned ConfigMap back", lambda: fake_kube.get(*CONFIGMAP, NS, "smollm2-tuned"))
        back = fake_kube.get(*CONFIGMAP, NS, "smollm2-tuned")
        assert back is not None and back["data"] == data
        assert back["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert runner.exception is None, runner.output
    print(f"tuned ConfigMap restored {seconds:.2f} s after its deletion")


def test_the_memory_tells_an_owned_change_from_metadata_noise() -> None:
    """`ServiceMemory.observe_child` on hand-built watch events: only a deletion, or a rendered field that
    differs from the apply's answer, asks for the child to be applied again."""
    rendered = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "namespace": NS, "labels": {"app": "s"}},
        "spec": {"ports": [{"name": "http", "port": 80}], "selector": {"app": "s"}},
    }
    answer = copy.deepcopy(rendered)  # the server defaults fields beside the rendered ones
    answer["metadata"].update(resourceVersion="10", uid="u1", managedFields=[{"manager": "specfleet"}])
    answer["spec"].update(clusterIP="10.0.0.7", type="ClusterIP")
    answer["spec"]["ports"][0].update(protocol="TCP", targetPort=80)
    memory, key = ServiceMemory(), ("Service", "s")
    memory.record(key, digest(rendered), answer, 0.0, owned_shape(rendered))

    def event(version: str, edit: Any) -> dict[str, Any]:
        obj = copy.deepcopy(answer)
        obj["metadata"]["resourceVersion"] = version
        edit(obj)
        return obj

    noise = event("11", lambda o: o["metadata"].update(annotations={"x": "y"}, managedFields=[]))
    assert not memory.observe_child(key, noise, deleted=False)
    assert memory.state(key, digest(rendered), 1.0, 1800) == "current"
    assert not memory.observe_child(key, event("9", lambda o: o["spec"].update(selector={})), deleted=False)
    port = event("12", lambda o: o["spec"]["ports"][0].update(port=8080))
    assert memory.observe_child(key, port, deleted=False)
    assert memory.state(key, digest(rendered), 1.0, 1800) == "changed"
    memory.record(key, digest(rendered), event("13", lambda o: None), 2.0, owned_shape(rendered))
    label = event("14", lambda o: o["metadata"]["labels"].update(app="other"))
    assert memory.observe_child(key, label, deleted=False)
    memory.record(key, digest(rendered), event("15", lambda o: None), 3.0, owned_shape(rendered))
    assert memory.observe_child(key, event("16", lambda o: None), deleted=True)
    assert not memory.observe_child(key, event("16", lambda o: None), deleted=True)  # already forgotten
