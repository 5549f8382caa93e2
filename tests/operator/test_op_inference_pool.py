"""routing.mode endpoint-picker: the operator renders an InferencePool (the Gateway API Inference Extension's
GA API), the router pods' ext_proc Service it names and an optional HTTPRoute, each valid for its upstream
CRD (tests/fixtures/crds, sliced from the projects' release manifests), and the reconcile applies and
removes them as the mode changes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube, Rbac
from isvc_schema_tools import REPO, admission_errors
from kube_admission import apply_defaults, cel_errors, prune, schema_errors
from specfleet.operator import InvalidInferenceService, load_inference_service
from specfleet.operator.render import render_engine_workloads, render_router_children
from specfleet.operator.resources import EPP_PORT
from specfleet.router.cli import build_parser as router_parser
from test_op_reconcile import CONFIG, DEPLOY, ISVC, NS, SECRET, SERVICE, reconcile

CRDS = REPO / "tests" / "fixtures" / "crds"
POOL = ("/apis/inference.networking.k8s.io/v1", "inferencepools")
PICKER = {"mode": "endpoint-picker", "endpointPicker": {"gateway": {"name": "inference-gateway"}}}


def doc(**routing: Any) -> dict[str, Any]:
    d = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    d["metadata"].update(namespace=NS, uid="uid-1", generation=1)
    d["spec"]["routing"] = {**d["spec"].get("routing", {}), **routing}
    return d


def upstream_admission(crd_file: str, obj: dict[str, Any]) -> list[str]:
    """The upstream CRD's defaulting, its schema with unknown fields refused, its CEL rules, and no field
    pruned (a pruned field would be one the gateway's controller never sees)."""
    crd = yaml.safe_load((CRDS / crd_file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    assert f"{crd['spec']['group']}/{version['name']}" == obj["apiVersion"]
    schema = version["schema"]["openAPIV3Schema"]
    body = {k: v for k, v in apply_defaults(schema, obj).items() if k != "metadata"}
    strict = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k != "metadata"}}
    errors = schema_errors(strict, body) + cel_errors(schema, body)
    if prune(schema, body) != body:
        errors.append(f"fields the {obj['kind']} schema does not declare were pruned")
    return errors


def by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def test_the_pool_its_picker_and_the_route_are_valid_upstream_and_point_at_each_other() -> None:
    assert admission_errors(doc(**PICKER)) == []
    isvc = load_inference_service(doc(**PICKER))
    children = by_kind(render_router_children(isvc, CONFIG))
    pool, route = children["InferencePool/smollm2"], children["HTTPRoute/smollm2"]
    epp, router = children["Service/smollm2-epp"], children["Deployment/smollm2-router"]
    assert upstream_admission("gie-inferencepool.yaml", pool) == []
    assert upstream_admission("gateway-api-httproute.yaml", route) == []
    # the pool selects the engine pods (not the router's) on the engine port
    (engines,) = render_engine_workloads(isvc, CONFIG)
    labels = engines["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert not selector.items() <= router["spec"]["template"]["metadata"]["labels"].items()
    (container,) = engines["spec"]["template"]["spec"]["containers"][:1]
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    # its endpoint picker: the Service over the router pods' ext_proc port, which the router serves
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]["number"], ref["failureMode"]) == ("smollm2-epp", EPP_PORT, "FailClose")
    assert epp["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    (router_container,) = router["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in router_container["ports"]}
    assert ports[epp["spec"]["ports"][0]["targetPort"]] == EPP_PORT
    assert router_parser().parse_args(router_container["args"]).ext_proc_port == EPP_PORT
    # the route: the named Gateway to the pool
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "smollm2",
    }
    # what the upstream schemas refuse, they refuse here too (the slices are live)
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert upstream_admission("gie-inferencepool.yaml", bad)
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    assert upstream_admission("gie-inferencepool.yaml", bad)


def test_proxy_mode_renders_none_of_it_and_the_picker_needs_the_router() -> None:
    kinds = {c["kind"] for c in render_router_children(load_inference_service(doc()), CONFIG)}
    assert not kinds & {"InferencePool", "HTTPRoute"}
    without_gateway = by_kind(
        render_router_children(load_inference_service(doc(mode="endpoint-picker")), CONFIG)
    )
    assert "InferencePool/smollm2" in without_gateway and "HTTPRoute/smollm2" not in without_gateway
    off = doc(mode="endpoint-picker", enabled=False)
    assert any("routing.mode endpoint-picker needs routing.enabled" in e for e in admission_errors(off))
    with pytest.raises(InvalidInferenceService, match="routing.mode endpoint-picker needs routing.enabled"):
        load_inference_service(off)


def test_reconcile_applies_the_pool_and_removes_it_with_proxy_mode() -> None:
    fake = FakeKube(
        rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}}),
        # no HTTPRoute CRD (the API double serves single-version CRDs): its deletion finds none to delete
        crds=(REPO / "crds" / "inferenceservice.yaml", CRDS / "gie-inferencepool.yaml"),
    ).start()
    try:
        d = doc(mode="endpoint-picker")
        d["metadata"] = {"name": "smollm2"}
        fake.put(*ISVC, NS, d)
        outcome = reconcile(fake)
        assert fake.get(*POOL, NS, "smollm2") is not None and "RouterInferencePool" in outcome.children
        assert fake.get(*SERVICE, NS, "smollm2-epp") is not None
        d = copy.deepcopy(fake.get(*ISVC, NS, "smollm2"))
        d["spec"]["routing"]["mode"] = "proxy"
        fake.put(*ISVC, NS, d)
        reconcile(fake)
        assert fake.get(*POOL, NS, "smollm2") is None
        assert fake.get(*SERVICE, NS, "smollm2-epp") is None
        assert fake.get(*SERVICE, NS, "smollm2") is not None  # the router's own Service stays
    finally:
        fake.stop()


# ---- prefill/decode roles behind the picker: the signing key ----------------------------------------------
PD_KEY_FILE = "/var/run/secrets/specfleet/pd-key/key"


def pd_doc(**routing: Any) -> dict[str, Any]:
    d = yaml.safe_load((REPO / "examples" / "smollm2-cpu-pd.yaml").read_text())
    d["metadata"] = {"name": "smollm2", "namespace": NS, "uid": "uid-1", "generation": 1}
    d["spec"]["routing"] = {**d["spec"].get("routing", {}), **routing}
    return d


def key_mounts(pod: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes of the NAME-pd-key Secret, and its first container's mounts of them."""
    volumes = [v for v in pod.get("volumes", []) if v.get("secret", {}).get("secretName") == "smollm2-pd-key"]
    names = {v["name"] for v in volumes}
    return volumes, [m for m in pod["containers"][0].get("volumeMounts", []) if m["name"] in names]


def test_roles_behind_the_picker_mount_the_signing_key_into_the_router_and_decode_pods() -> None:
    from isvc_schema_tools import k8s_validate
    from specfleet.engine.server.cli import build_parser as engine_parser

    assert admission_errors(pd_doc(**PICKER)) == []
    # the volume and the path are the operator's: a pod template may not take them
    clash = pd_doc(**PICKER)
    clash["spec"]["pod"] = {"volumes": [{"name": "pd-key", "emptyDir": {}}]}
    assert any("pd-key" in e for e in admission_errors(clash))
    clash["spec"]["pod"] = {
        "volumeMounts": [{"name": "mine", "mountPath": "/var/run/secrets/specfleet/pd-key"}]
    }
    assert any("/var/run/secrets/specfleet/pd-key" in e for e in admission_errors(clash))
    isvc = load_inference_service(pd_doc(**PICKER))
    assert isvc.signs_prefill
    prefill, decode = render_engine_workloads(isvc, CONFIG)
    router = by_kind(render_router_children(isvc, CONFIG))["Deployment/smollm2-router"]
    for deployment in (decode, router):
        k8s_validate(deployment)
        pod = deployment["spec"]["template"]["spec"]
        (volume,), (mount,) = key_mounts(pod)
        assert volume["secret"]["items"] == [{"key": "key", "path": "key"}]
        assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10000
        assert mount["readOnly"] and f"{mount['mountPath']}/key" == PD_KEY_FILE
    # the flags as each program parses them: the same file, the picker on its ext_proc port
    engine_args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert engine_parser().parse_args(engine_args).remote_prefill_key_file == PD_KEY_FILE
    router_args = router_parser().parse_args(router["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (router_args.remote_prefill_key_file, router_args.ext_proc_port) == (PD_KEY_FILE, EPP_PORT)
    # the prefill engines send nothing anywhere: no key; nor does any pod outside roles behind the picker
    prefill_pod = prefill["spec"]["template"]["spec"]
    assert key_mounts(prefill_pod) == ([], [])
    assert "--remote-prefill-key-file" not in prefill_pod["containers"][0]["args"]
    for other in (load_inference_service(pd_doc()), load_inference_service(doc(**PICKER))):
        assert not other.signs_prefill
        children = [*render_engine_workloads(other, CONFIG), *render_router_children(other, CONFIG)]
        for deployment in (c for c in children if c["kind"] == "Deployment"):
            assert key_mounts(deployment["spec"]["template"]["spec"]) == ([], [])
            assert (
                "--remote-prefill-key-file"
                not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
            )


def test_reconcile_creates_the_signing_key_once_and_never_adopts_a_users_secret(tmp_path) -> None:
    import base64

    from specfleet.engine.kv_transfer.prefill_signature import read_key

    fake = FakeKube(
        rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}}),
        crds=(REPO / "crds" / "inferenceservice.yaml", CRDS / "gie-inferencepool.yaml"),
    ).start()
    try:
        fake.put(*ISVC, NS, pd_doc(mode="endpoint-picker"))
        outcome = reconcile(fake)
        secret = fake.get(*SECRET, NS, "smollm2-pd-key")
        assert secret is not None and secret["immutable"] is True
        assert [o["uid"] for o in secret["metadata"]["ownerReferences"]] == [
            fake.get(*ISVC, NS, "smollm2")["metadata"]["uid"]
        ]
        (tmp_path / "key").write_bytes(base64.b64decode(secret["data"]["key"]))
        assert len(read_key(tmp_path / "key")) == 43  # what the engine and the router read at start
        assert any(
            e.message == "created Secret smollm2-pd-key (the endpoint picker's prefill signing key)"
            for e in outcome.events
        )
        for _ in range(2):  # not rotated by later passes (a fresh operator's first pass included)
            reconcile(fake)
            again = fake.get(*SECRET, NS, "smollm2-pd-key")
            assert again["data"] == secret["data"]
            assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
        assert fake.get(*DEPLOY, NS, "smollm2-decode") is not None
    finally:
        fake.stop()

    fake = FakeKube(
        rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}}),
        crds=(REPO / "crds" / "inferenceservice.yaml", CRDS / "gie-inferencepool.yaml"),
    ).start()
    try:  # a Secret of that name that specfleet did not create: no decode pod mounts it as the key
        users = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "smollm2-pd-key"}, "data": {}}
        fake.put(*SECRET, NS, users)
        fake.put(*ISVC, NS, pd_doc(mode="endpoint-picker"))
        reconcile(fake)
        status = fake.get(*ISVC, NS, "smollm2")["status"]
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "PrefillKeySecretConflict")
        assert "Secret smollm2-pd-key already exists" in degraded["message"]
        assert "prefill signing key" in degraded["message"]
        assert fake.get(*DEPLOY, NS, "smollm2-decode") is None
        assert "ownerReferences" not in fake.get(*SECRET, NS, "smollm2-pd-key")["metadata"]
    finally:
        fake.stop()
