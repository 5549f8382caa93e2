"""The API double's semantics (tests/fake_kube.py), each checked on its own, so that a test that relies on
one of them fails for the right reason: RBAC from the rendered chart, subresources, generation, CRD
admission, merge patch and server-side apply, finalizers, garbage collection."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import httpx
import pytest
import yaml
from fake_kube import FakeKube, Rbac
from isvc_schema_tools import REPO
from test_op_reconcile import NS

ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
ISVC_PATH = f"{ISVC[0]}/namespaces/{NS}/{ISVC[1]}"
DEPLOY = ("/apis/apps/v1", "deployments")
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


def example() -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())


def call(
    fake: FakeKube,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    **params: str,
) -> httpx.Response:
    return httpx.request(
        method,
        fake.url + path,
        params=params,
        timeout=10,
        content=None if body is None else json.dumps(body),
        headers={"Content-Type": content_type},
    )


def test_rbac_comes_from_the_rendered_chart() -> None:
    rbac = Rbac.from_chart({"watch": {"namespaces": [NS]}})
    assert rbac.allows("patch", "serving.specfleet.io", "inferenceservices/status", NS)
    assert rbac.allows("watch", "apps", "deployments", NS)
    # least privilege: the GC deletes children; the operator deletes only children it stops rendering (a PDB
    # below two replicas, the router's objects with routing off), never the admin Secret
    assert not rbac.allows("delete", "", "secrets", NS)
    assert not rbac.allows("update", "apps", "deployments", NS)
    assert not rbac.allows("get", "apps", "deployments", "elsewhere")  # a Role per watched namespace only
    assert not rbac.allows("list", "", "secrets", NS)
    assert rbac.allows("list", "", "namespaces", None)  # kopf's discovery, cluster-wide and read-only
    no_monitor = Rbac.from_chart({"watch": {"namespaces": [NS]}, "serviceMonitor": {"enabled": False}})
    assert not no_monitor.allows("create", "monitoring.coreos.com", "servicemonitors", NS)
    wide = Rbac.from_chart({"watch": {"allNamespaces": True}})
    assert wide.allows("get", "apps", "deployments", "any-namespace")


def test_a_missing_verb_is_a_403(fake_kube: FakeKube) -> None:
    fake_kube.put(
        *DEPLOY,
        NS,
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}, "spec": {"replicas": 1}},
    )
    assert call(fake_kube, "GET", f"/apis/apps/v1/namespaces/{NS}/deployments/d").status_code == 200
    denied = call(fake_kube, "DELETE", f"/api/v1/namespaces/{NS}/secrets/x")
    assert denied.status_code == 403 and 'cannot delete resource "secrets"' in denied.json()["message"]
    assert call(fake_kube, "GET", "/api/v1/namespaces/other/secrets/x").status_code == 403


def test_owner_references_that_block_deletion_need_the_owners_finalizers() -> None:
    """OwnerReferencesPermissionEnforcement: without `update` on inferenceservices/finalizers the operator
    could not create a single child on such clusters (the chart grants it)."""
    objects = yaml.safe_load_all(_role_without_finalizers())
    fake = FakeKube(rbac=Rbac.from_objects(list(objects), "op", NS)).start()
    try:
        owner = fake.put(*ISVC, NS, example())
        ref = {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "name": "smollm2",
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "ownerReferences": [ref]}}
        refused = call(fake, "POST", f"/api/v1/namespaces/{NS}/services", body)
        assert refused.status_code == 403 and "inferenceservices/finalizers" in refused.json()["message"]
        ref["blockOwnerDeletion"] = False
        assert call(fake, "POST", f"/api/v1/namespaces/{NS}/services", body).status_code == 201
    finally:
        fake.stop()


def _role_without_finalizers() -> str:
    return f"""
kind: Role
metadata: {{name: op, namespace: {NS}}}
rules:
  - {{apiGroups: [""], resources: [services], verbs: [create, get]}}
---
kind: RoleBinding
metadata: {{name: op, namespace: {NS}}}
roleRef: {{kind: Role, name: op}}
subjects: [{{kind: ServiceAccount, name: op, namespace: {NS}}}]
"""


def test_status_subresource_and_generation(fake_kube: FakeKube) -> None:
    fake_kube.rbac = None  # as a cluster admin: the operator may not scale
    created = fake_kube.put(*ISVC, NS, example())
    assert created["metadata"]["generation"] == 1
    # the object's endpoint ignores status; /status ignores everything else
    call(
        fake_kube,
        "PATCH",
        f"{ISVC_PATH}/smollm2",
        {"status": {"replicas": 9}, "metadata": {"labels": {"a": "b"}}},
        MERGE,
    )
    stored = fake_kube.get(*ISVC, NS, "smollm2")
    assert stored is not None and "status" not in stored and stored["metadata"]["generation"] == 1
    call(
        fake_kube,
        "PATCH",
        f"{ISVC_PATH}/smollm2/status",
        {"status": {"replicas": 2}, "spec": {"replicas": 5}},
        MERGE,
    )
    stored = fake_kube.get(*ISVC, NS, "smollm2")
    assert stored["status"]["replicas"] == 2 and stored["spec"]["replicas"] == 1
    assert stored["metadata"]["generation"] == 1
    # spec and /scale writes bump the generation
    scaled = call(fake_kube, "PATCH", f"{ISVC_PATH}/smollm2/scale", {"spec": {"replicas": 3}}, MERGE)
    assert scaled.status_code == 200 and scaled.json()["kind"] == "Scale"
    stored = fake_kube.get(*ISVC, NS, "smollm2")
    assert stored["spec"]["replicas"] == 3 and stored["metadata"]["generation"] == 2


def test_custom_resources_are_defaulted_pruned_and_validated(fake_kube: FakeKube) -> None:
    fake_kube.rbac = None
    doc = example()
    doc["spec"]["speculative"] = {"method": "draft"}
    refused = call(fake_kube, "POST", ISVC_PATH, doc)
    assert refused.status_code == 422 and "draftModel" in refused.json()["message"]  # the CEL rule's message
    doc = example()
    doc["spec"]["unknownField"] = 1
    created = call(fake_kube, "POST", ISVC_PATH, doc).json()
    assert "unknownField" not in created["spec"]  # pruned
    assert created["spec"]["engine"]["blockSize"] == 16  # defaulted
    call(
        fake_kube,
        "PATCH",
        f"{ISVC_PATH}/smollm2/status",
        {"status": {"kopf": {"progress": {}}, "replicas": 1}},
        MERGE,
    )
    assert fake_kube.get(*ISVC, NS, "smollm2")["status"] == {"replicas": 1}
    bad = call(
        fake_kube,
        "PATCH",
        f"{ISVC_PATH}/smollm2/status",
        {"status": {"conditions": [{"type": "Ready"}]}},
        MERGE,
    )
    assert bad.status_code == 422 and "status" in bad.json()["message"]  # a condition needs its status


def test_merge_patch_replaces_lists_and_server_side_apply_merges_list_maps(fake_kube: FakeKube) -> None:
    """Why two status writers need server-side apply: a merge patch of `conditions` replaces the list."""
    fake_kube.rbac = None
    fake_kube.put(*ISVC, NS, example())
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": ""}
    tuned = {"type": "Tuned", "status": "True", "reason": "Holding", "message": ""}
    path = f"{ISVC_PATH}/smollm2/status"
    call(fake_kube, "PATCH", path, {"status": {"conditions": [ready]}}, MERGE)
    call(fake_kube, "PATCH", path, {"status": {"conditions": [tuned]}}, MERGE)
    assert [c["type"] for c in fake_kube.get(*ISVC, NS, "smollm2")["status"]["conditions"]] == ["Tuned"]

    def apply(manager: str, status: dict[str, Any], force: bool = True) -> httpx.Response:
        body = {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "smollm2"},
            "status": status,
        }
        return call(fake_kube, "PATCH", path, body, APPLY, fieldManager=manager, force=str(force).lower())

    assert apply("operator", {"conditions": [ready], "replicas": 1}).status_code == 200
    assert apply("tuner", {"conditions": [tuned], "tuning": {"reason": "x"}}).status_code == 200
    assert apply("operator", {"conditions": [{**ready, "status": "False"}]}).status_code == 200
    status = fake_kube.get(*ISVC, NS, "smollm2")["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Ready": "False", "Tuned": "True"}
    assert "replicas" not in status  # the operator stopped applying it and nobody else owns it
    assert status["tuning"] == {"reason": "x"}
    owners = fake_kube.fields(*ISVC, NS, "smollm2")
    assert ".status.conditions[type=Tuned].reason" in owners["tuner"]
    assert ".status.conditions[type=Ready].status" in owners["operator"]
    conflict = apply("other", {"tuning": {"reason": "y"}}, force=False)
    assert conflict.status_code == 409 and '"tuner"' in conflict.json()["message"]
    assert apply("other", {"tuning": {"reason": "y"}}).status_code == 200  # force takes the field over
    assert ".status.tuning.reason" not in fake_kube.fields(*ISVC, NS, "smollm2").get("tuner", [])


def test_finalizers_hold_a_deletion_and_garbage_collection_follows(fake_kube: FakeKube) -> None:
    fake_kube.rbac = None
    doc = example()
    doc["metadata"]["finalizers"] = ["example.com/hold"]
    owner = fake_kube.put(*ISVC, NS, doc)
    ref = {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "name": "smollm2",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    fake_kube.put(
        *DEPLOY,
        NS,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "smollm2", "ownerReferences": [ref]},
            "spec": {"replicas": 1},
        },
    )
    other = copy.deepcopy(ref) | {"uid": "someone-else", "name": "x"}
    fake_kube.put(
        "/api/v1",
        "secrets",
        NS,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "shared", "ownerReferences": [ref, other]},
        },
    )
    call(fake_kube, "DELETE", f"{ISVC_PATH}/smollm2")
    held = fake_kube.get(*ISVC, NS, "smollm2")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is not None  # the owner still exists
    more = call(
        fake_kube,
        "PATCH",
        f"{ISVC_PATH}/smollm2",
        {"metadata": {"finalizers": ["example.com/hold", "b"]}},
        MERGE,
    )
    assert more.status_code == 422 and "being deleted" in more.json()["message"]
    call(fake_kube, "PATCH", f"{ISVC_PATH}/smollm2", {"metadata": {"finalizers": None}}, MERGE)
    assert fake_kube.get(*ISVC, NS, "smollm2") is None
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is None  # garbage-collected with its owner
    # an owner that never existed counts as gone, as the real garbage collector treats a dangling reference
    assert fake_kube.get("/api/v1", "secrets", NS, "shared") is None


def test_watch_and_list_honour_label_selectors(fake_kube: FakeKube) -> None:
    fake_kube.rbac = None
    for name, labels in (("a", {"app": "x"}), ("b", {"app": "y"})):
        fake_kube.put(
            "/api/v1",
            "pods",
            NS,
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}},
        )
    listed = call(fake_kube, "GET", f"/api/v1/namespaces/{NS}/pods", labelSelector="app=x").json()
    assert [p["metadata"]["name"] for p in listed["items"]] == ["a"]

    async def first_event() -> dict[str, Any]:
        async with (
            httpx.AsyncClient(timeout=10) as client,
            client.stream(
                "GET",
                f"{fake_kube.url}/api/v1/namespaces/{NS}/pods",
                params={"watch": "true", "labelSelector": "app=y"},
            ) as response,
        ):
            async for line in response.aiter_lines():
                return json.loads(line)
        raise AssertionError("no event")

    assert asyncio.run(first_event())["object"]["metadata"]["name"] == "b"


@pytest.mark.parametrize("path", ["/version", "/apis", "/api/v1"])
def test_discovery_needs_no_rule(fake_kube: FakeKube, path: str) -> None:
    assert call(fake_kube, "GET", path).status_code == 200
