"""Engine workloads beyond one Deployment: prefill/decode roles (spec.disaggregation) and multi-node model
copies as a LeaderWorkerSet (engine.nodes > 1). Rendered objects are validated against Kubernetes 1.30
(kubernetes-validate) and the LeaderWorkerSet against the upstream CRD vendored in tests/fixtures/crds/; the
reconcile runs against the API double (tests/fake_kube.py)."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube, Rbac
from isvc_schema_tools import REPO, admission_errors, k8s_validate
from kube_admission import apply_defaults, cel_errors, prune, schema_errors
from rollouts import report_router_rolled_out
from specfleet.engine.python_child import python_command
from specfleet.engine.server.cli import build_parser, engine_config_kwargs
from specfleet.operator import InferenceService, load_inference_service
from specfleet.operator.conditions import Workload, deployment_conditions
from specfleet.operator.config import OperatorConfig
from specfleet.operator.render import (
    render_engine_workloads,
    render_network_policy,
    render_pdb,
    render_router_children,
    render_servicemonitor,
)
from specfleet.operator.resources import KV_TRANSFER_PORT, LABEL_ISVC, LABEL_ROLE
from specfleet.router.cli import build_parser as router_parser
from test_op_reconcile import CONFIG, ISVC, NS, SERVICE, conditions, reconcile

LWS_CRD = REPO / "tests" / "fixtures" / "crds" / "lws-leaderworkerset.yaml"
LWS = ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets")
DEPLOY = ("/apis/apps/v1", "deployments")
PD_EXAMPLE = REPO / "examples" / "smollm2-cpu-pd.yaml"
GPU_CONFIG = OperatorConfig(
    engine_image="registry.example/engine:cuda", engine_cpu_image="registry.example/engine:cpu"
)


def pd_isvc(**spec: Any) -> InferenceService:
    doc = yaml.safe_load(PD_EXAMPLE.read_text())
    doc["metadata"].update(namespace=NS, uid="uid-pd", generation=1)
    doc["spec"].update(spec)
    return load_inference_service(doc)


def multinode_doc(nodes: int = 2, stages: int = 4, gpus: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "big", "namespace": NS, "uid": "uid-big", "generation": 1},
        "spec": {
            "model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "engine": {"pipelineParallelSize": stages, "nodes": nodes},
            "resources": {"gpus": gpus, "cpu": "16", "memory": "200Gi"},
            "replicas": 2,
        },
    }


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (engine,) = [c for c in pod_spec["containers"] if c["name"] == "engine"]
    return engine


def env(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(pod_spec)["env"]}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---- prefill/decode roles: rendering ----------------------------------------------------------------------
def test_roles_render_one_deployment_each_with_its_flags_and_kv_port() -> None:
    isvc = pd_isvc()
    prefill, decode = render_engine_workloads(isvc, CONFIG)
    assert [d["metadata"]["name"] for d in (prefill, decode)] == ["smollm2-pd-prefill", "smollm2-pd-decode"]
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 2)
    for deployment, role in ((prefill, "prefill"), (decode, "decode")):
        k8s_validate(deployment)
        pod = deployment["spec"]["template"]
        assert (
            pod["metadata"]["labels"][LABEL_ROLE] == role
            and pod["metadata"]["labels"][LABEL_ISVC] == "smollm2-pd"
        )
        # the engine's own parser reads the command line back into its config
        config = engine_config_kwargs(build_parser().parse_args(container(pod["spec"])["args"]))
        assert config["kv_role"] == role
    # each Deployment's (immutable) selector takes its own role's pods only
    for one, other in ((prefill, decode), (decode, prefill)):
        assert selects(one["spec"]["selector"]["matchLabels"], one["spec"]["template"]["metadata"]["labels"])
        assert not selects(
            one["spec"]["selector"]["matchLabels"], other["spec"]["template"]["metadata"]["labels"]
        )
    # the prefill engine serves its held KV on the pod IP (downward API, defined before the args use it)
    pod = prefill["spec"]["template"]["spec"]
    config = engine_config_kwargs(build_parser().parse_args(container(pod)["args"]))
    assert (config["kv_transfer_host"], config["kv_transfer_port"]) == (
        "$(SPECFLEET_POD_IP)",
        KV_TRANSFER_PORT,
    )
    assert container(pod)["env"][0] == {
        "name": "SPECFLEET_POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    assert {"name": "kv", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"} in container(pod)["ports"]
    assert "kv" not in {p["name"] for p in container(decode["spec"]["template"]["spec"])["ports"]}


def test_the_router_finds_each_role_through_its_own_headless_service() -> None:
    isvc = pd_isvc()
    prefill, decode = render_engine_workloads(isvc, CONFIG)
    children = render_router_children(isvc, CONFIG)
    services = {o["metadata"]["name"]: o for o in children if o["kind"] == "Service"}
    assert sorted(services) == ["smollm2-pd-decode", "smollm2-pd-prefill"]  # no smollm2-pd-engines
    for obj in children:
        k8s_validate(obj)
    for deployment in (prefill, decode):
        pods = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [n for n, s in services.items() if selects(s["spec"]["selector"], pods)]
        assert (
            matching == [deployment["metadata"]["name"]]
            and services[matching[0]]["spec"]["clusterIP"] == "None"
        )
    (router,) = [o for o in children if o["kind"] == "Deployment"]
    args = router_parser().parse_args(router["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (args.service, args.prefill_service) == ("smollm2-pd-decode", "smollm2-pd-prefill")
    # the ServiceMonitor scrapes both roles once each and labels the series with the role
    monitor = render_servicemonitor(isvc)
    assert all(
        selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        for s in services.values()
    )
    relabel = monitor["spec"]["endpoints"][0]["relabelings"][-1]
    assert relabel["targetLabel"] == "specfleet_role"
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_serving_specfleet_io_role"]


def test_pdb_spans_both_roles_and_the_network_policy_opens_the_kv_port_to_the_service_only() -> None:
    isvc = pd_isvc(disaggregation={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    pdb = render_pdb(isvc)
    assert pdb is not None and pdb["spec"]["selector"]["matchLabels"] == {LABEL_ISVC: "smollm2-pd"}
    policy = render_network_policy(isvc, CONFIG)
    k8s_validate(policy)
    (kv_rule,) = [
        r
        for r in policy["spec"]["ingress"]
        if r.get("ports") == [{"port": KV_TRANSFER_PORT, "protocol": "TCP"}]
    ]
    assert kv_rule["from"] == [
        {"podSelector": {"matchLabels": {LABEL_ISVC: "smollm2-pd"}}},
        {"podSelector": {"matchLabels": {"serving.specfleet.io/router": "smollm2-pd"}}},
    ]


def test_autoscaling_scales_the_decode_engines_and_leaves_prefill_at_its_count() -> None:
    doc = yaml.safe_load(PD_EXAMPLE.read_text())
    doc["spec"].update(
        autotune={"enabled": True}, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 6}
    )
    doc["status"] = {"autoscaling": {"replicas": 5}}
    isvc = load_inference_service(doc)
    prefill, decode = render_engine_workloads(isvc, CONFIG)
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 5)
    assert isvc.desired_replicas == 5 and isvc.total_engines == 6
    doc.pop("status")  # before the tuner's first decision: the spec's decode count
    assert load_inference_service(doc).desired_replicas == 2


def test_specfleet_up_and_the_crd_accept_the_same_example() -> None:
    doc = yaml.safe_load(PD_EXAMPLE.read_text())
    assert admission_errors(doc) == []
    from specfleet.fleet.supervisor import local_engine_command

    command = local_engine_command(load_inference_service(doc), 9000, ["--kv-role=prefill"])
    assert "--kv-role=prefill" in command and "$(SPECFLEET_POD_IP)" not in " ".join(command)


# ---- status over both roles -------------------------------------------------------------------------------
def deployment(replicas: int, ready: int, generation: int = 1, updated: int | None = None) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
        },
    }


def test_ready_only_when_every_role_is() -> None:
    isvc = pd_isvc()
    both = [
        Workload("Deployment smollm2-pd-prefill", 1, deployment(1, 1)),
        Workload("Deployment smollm2-pd-decode", 2, deployment(2, 2)),
    ]
    ready, progressing, degraded = deployment_conditions(isvc, both)
    assert (ready.status, ready.reason, progressing.status, degraded.status) == (
        "True",
        "AllReplicasReady",
        "False",
        "False",
    )
    decode_down = [both[0], Workload("Deployment smollm2-pd-decode", 2, deployment(2, 1))]
    ready, progressing, _ = deployment_conditions(isvc, decode_down)
    assert (ready.status, ready.reason, progressing.status) == ("False", "ReplicasNotReady", "True")
    assert "Deployment smollm2-pd-decode: scaling to 2 replicas: 1/2 available" in ready.message
    assert "Deployment smollm2-pd-prefill: 1/1 replicas available" in ready.message
    pending = [both[0], Workload("Deployment smollm2-pd-decode", 2, None)]
    assert deployment_conditions(isvc, pending)[0].status == "Unknown"
    stuck = deployment(1, 0)
    stuck["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "ReplicaSet has timed out progressing",
        }
    ]
    ready, progressing, degraded = deployment_conditions(isvc, [Workload("Deployment p", 1, stuck), both[1]])
    assert (progressing.reason, degraded.status, degraded.reason) == (
        "ProgressDeadlineExceeded",
        "True",
        "ProgressDeadlineExceeded",
    )


# ---- prefill/decode roles: the reconcile against the API double ------------------------------------------
def put_pd(fake: FakeKube, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load(PD_EXAMPLE.read_text())
    doc["metadata"]["name"] = "smollm2"
    doc["spec"].update(spec)
    return fake.put(*ISVC, NS, doc)


def report(fake: FakeKube, name: str, ready: int) -> None:
    obj = fake.get(*DEPLOY, NS, name)
    assert obj is not None
    obj["status"] = {
        "observedGeneration": obj["metadata"]["generation"],
        "replicas": obj["spec"]["replicas"],
        "updatedReplicas": obj["spec"]["replicas"],
        "readyReplicas": ready,
        "availableReplicas": ready,
    }
    fake.put(*DEPLOY, NS, obj)


def test_reconcile_rolls_out_both_roles_and_reports_ready_when_both_are(fake_kube: FakeKube) -> None:
    put_pd(fake_kube)
    outcome = reconcile(fake_kube)
    assert {
        "Deployment/prefill",
        "Deployment/decode",
        "EnginesService/prefill",
        "EnginesService/decode",
    } <= set(outcome.children)
    assert (
        fake_kube.get(*DEPLOY, NS, "smollm2") is None
        and fake_kube.get(*SERVICE, NS, "smollm2-engines") is None
    )
    report(fake_kube, "smollm2-prefill", 1)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("Unknown", "Pending")  # decode not reported yet
    report(fake_kube, "smollm2-decode", 2)
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("Unknown", "Pending")  # the router not reported yet
    report_router_rolled_out(fake_kube, NS, "smollm2")
    reconcile(fake_kube)
    assert conditions(fake_kube)["Ready"] == ("True", "AllReplicasReady")
    status = fake_kube.get(*ISVC, NS, "smollm2")["status"]
    assert (status["replicas"], status["readyReplicas"]) == (3, 3)
    assert fake_kube.get(*("/apis/policy/v1", "poddisruptionbudgets"), NS, "smollm2") is not None


def test_switching_roles_off_and_on_leaves_no_stale_engines(fake_kube: FakeKube) -> None:
    put_pd(fake_kube)
    reconcile(fake_kube)
    doc = copy.deepcopy(fake_kube.get(*ISVC, NS, "smollm2"))
    assert doc is not None
    doc["spec"].pop("disaggregation")
    fake_kube.put(*ISVC, NS, doc)
    reconcile(fake_kube)
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is not None
    for name in ("smollm2-prefill", "smollm2-decode"):
        assert fake_kube.get(*DEPLOY, NS, name) is None and fake_kube.get(*SERVICE, NS, name) is None
    assert fake_kube.get(*SERVICE, NS, "smollm2-engines") is not None
    doc = copy.deepcopy(fake_kube.get(*ISVC, NS, "smollm2"))
    doc["spec"]["disaggregation"] = {}
    fake_kube.put(*ISVC, NS, doc)
    reconcile(fake_kube)
    assert (
        fake_kube.get(*DEPLOY, NS, "smollm2") is None
        and fake_kube.get(*SERVICE, NS, "smollm2-engines") is None
    )
    assert fake_kube.get(*DEPLOY, NS, "smollm2-decode")["spec"]["replicas"] == 1


def test_admission_refuses_roles_without_the_router(fake_kube: FakeKube) -> None:
    with pytest.raises(Exception, match="needs routing.enabled"):
        put_pd(fake_kube, routing={"enabled": False})


# ---- multi-node: LeaderWorkerSet ------------------------------------------------------------------------
@functools.cache
def lws_schema() -> dict[str, Any]:
    crd = yaml.load(LWS_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 0.4 MB
    (version,) = crd["spec"]["versions"]
    assert (crd["spec"]["group"], version["name"]) == ("leaderworkerset.x-k8s.io", "v1")
    return version["schema"]["openAPIV3Schema"]


def lws_admission(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The upstream CRD's defaulting, then its schema with unknown fields refused (a pruned field would be a
    field the controller never sees) and its CEL rules."""
    schema = lws_schema()
    body = {k: v for k, v in apply_defaults(schema, obj).items() if k != "metadata"}
    strict = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k != "metadata"}}
    errors = schema_errors(strict, body) + cel_errors(schema, body)
    pruned = prune(schema, body)
    if pruned != body:
        errors.append("fields the LeaderWorkerSet schema does not declare were pruned")
    return body, errors


def test_multinode_renders_a_leader_worker_set_valid_for_the_upstream_crd() -> None:
    isvc = load_inference_service(multinode_doc())
    assert admission_errors(multinode_doc()) == []
    (lws,) = render_engine_workloads(isvc, GPU_CONFIG)
    assert (lws["apiVersion"], lws["kind"], lws["metadata"]["name"]) == (
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
        "big",
    )
    stored, errors = lws_admission(lws)
    assert errors == []
    template = stored["spec"]["leaderWorkerTemplate"]
    assert (stored["spec"]["replicas"], template["size"], template["restartPolicy"]) == (
        2,
        2,
        "RecreateGroupOnPodRestart",
    )
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    for pod in (leader, worker):  # each pod template is a valid Kubernetes 1.30 PodTemplate too
        k8s_validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t", "namespace": NS},
                "template": pod,
            }
        )
        resources = container(pod["spec"])["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "2"  # the GPUs of this pod's stages, not the group's
        variables = env(pod["spec"])
        assert variables["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)" and variables["MASTER_PORT"] == "29500"
        assert variables["SPECFLEET_NODES"] == "2"
        assert variables["SPECFLEET_NODE_RANK"] == {
            "fieldRef": {"fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}
        }
        config = engine_config_kwargs(build_parser().parse_args(container(pod["spec"])["args"]))
        assert config["pipeline_parallel_size"] == 4
    # the leader is the endpoint (Services, PDB, tuner select it); workers serve nothing and are not selected
    assert (
        leader["metadata"]["labels"][LABEL_ISVC] == "big" and LABEL_ISVC not in worker["metadata"]["labels"]
    )
    assert "readinessProbe" in container(leader["spec"]) and "readinessProbe" not in container(worker["spec"])
    assert "rendezvous" in {p["name"] for p in container(leader["spec"])["ports"]}
    policy = render_network_policy(isvc, CONFIG)
    assert {"from": [{"podSelector": {"matchLabels": {"serving.specfleet.io/worker-of": "big"}}}]} in policy[
        "spec"
    ]["ingress"]


def test_a_broken_rendering_fails_the_upstream_schema() -> None:
    """The check can fail: the vendored schema refuses what the LWS API server would."""
    (lws,) = render_engine_workloads(load_inference_service(multinode_doc()), GPU_CONFIG)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert lws_admission(bad)[1]
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    assert lws_admission(bad)[1]


def test_reconcile_applies_the_leader_worker_set_where_its_crd_is_installed() -> None:
    fake = FakeKube(
        rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}}),
        crds=(REPO / "crds" / "inferenceservice.yaml", LWS_CRD),
    ).start()
    try:
        doc = multinode_doc()
        doc["metadata"] = {"name": "smollm2"}
        fake.put(*ISVC, NS, doc)
        outcome = reconcile(fake)
        lws = fake.get(*LWS, NS, "smollm2")
        assert lws is not None and "LeaderWorkerSet" in outcome.children
        assert fake.get(*DEPLOY, NS, "smollm2") is None
        assert conditions(fake)["Ready"] == ("Unknown", "Pending")
        lws["status"] = {
            "observedGeneration": lws["metadata"]["generation"],
            "replicas": 2,
            "readyReplicas": 2,
            "updatedReplicas": 2,
        }
        fake.put(*LWS, NS, lws)
        report_router_rolled_out(fake, NS, "smollm2")
        reconcile(fake)
        assert conditions(fake)["Ready"] == ("True", "AllReplicasReady")
        doc = copy.deepcopy(fake.get(*ISVC, NS, "smollm2"))
        doc["spec"]["engine"]["nodes"] = 1
        doc["spec"]["resources"]["gpus"] = 4
        fake.put(*ISVC, NS, doc)
        reconcile(fake)
        assert fake.get(*LWS, NS, "smollm2") is None and fake.get(*DEPLOY, NS, "smollm2") is not None
    finally:
        fake.stop()


def test_without_the_leader_worker_set_api_the_service_is_degraded_with_the_reason(
    fake_kube: FakeKube,
) -> None:
    doc = multinode_doc()
    doc["metadata"] = {"name": "smollm2"}
    fake_kube.put(*ISVC, NS, doc)
    outcome = reconcile(fake_kube)
    degraded = {c["type"]: c for c in outcome.status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and "install its controller" in degraded["message"]
    assert fake_kube.get(*DEPLOY, NS, "smollm2") is None


def test_the_engine_refuses_a_multi_node_group_with_a_message() -> None:
    """Until the engine joins ranks across pods, a LeaderWorkerSet's pods stop at once, saying why."""
    result = subprocess.run(
        python_command("-m", "specfleet.engine", "--help"),
        capture_output=True,
        text=True,
        env={**os.environ, "SPECFLEET_NODES": "2"},
        timeout=120,
    )
    assert result.returncode == 2 and "ranks across pods are not implemented" in result.stderr


def test_routing_discovers_leaders_only() -> None:
    isvc = load_inference_service(multinode_doc())
    (lws,) = render_engine_workloads(isvc, GPU_CONFIG)
    headless = [o for o in render_router_children(isvc, CONFIG) if o["kind"] == "Service"][0]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert selects(headless["spec"]["selector"], template["leaderTemplate"]["metadata"]["labels"])
    assert not selects(headless["spec"]["selector"], template["workerTemplate"]["metadata"]["labels"])
