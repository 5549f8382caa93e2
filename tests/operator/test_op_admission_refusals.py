"""What admission refuses so that it does not fail later (issue 34, section 2): each row passed admission
once and then failed as a refused child (Degraded) or never worked. Every row is refused three ways, each
message naming the field: by the CRD as `kubectl apply` meets it (schema with kubectl's Strict field
validation, then CEL: isvc_schema_tools.admission_errors), by the API double over HTTP (tests/fake_kube.py:
defaulting, pruning, schema, CEL, 422) and by the pydantic model the operator and `specfleet up` load."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import yaml
from fake_kube import FakeKube
from isvc_schema_tools import EXAMPLES, admission_errors
from specfleet.operator import InvalidInferenceService, load_inference_service
from specfleet.operator.config import OperatorConfig
from specfleet.operator.crd import kubernetes_schema
from specfleet.operator.engine_flags import OPERATOR_FLAGS
from specfleet.operator.kube_grammar import AFFINITY, TOLERATION, TOPOLOGY_SPREAD_CONSTRAINT
from specfleet.operator.render import (
    render_engine_workloads,
    render_network_policy,
    render_pdb,
    render_router_children,
    render_secret,
    render_service,
    render_servicemonitor,
    render_tuned_config,
)
from specfleet.operator.resources import (
    DNS1035_LABEL_MAX,
    ENGINE_CONTAINER,
    MAX_NAME_LENGTH,
)
from test_op_api_double import ISVC_PATH, call

CPU = yaml.safe_load((EXAMPLES[0].parent / "smollm2-cpu.yaml").read_text())
AUTOSCALED = {"enabled": True, "minReplicas": 0, "maxReplicas": 2}
LONG = "a" * 64


def _with(changes: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(CPU)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return doc


# (changes, text every refusal must contain: the field, strict: only kubectl's Strict field validation
# refuses it on a cluster, the double prunes it as the API server does without it)
ROWS: dict[str, tuple[dict[str, Any], str, bool]] = {
    "name too long for NAME-engines": ({"metadata.name": "a" * 56}, "metadata.name", False),
    "scale to zero without the router": (
        {"spec.autotune": {"enabled": True}, "spec.autoscaling": AUTOSCALED, "spec.routing.enabled": False},
        "minReplicas",
        False,
    ),
    "scale to zero without a queue timeout": (
        {"spec.autotune": {"enabled": True}, "spec.autoscaling": AUTOSCALED},
        "queueTimeoutSeconds",
        False,
    ),
    "toleration operator": (
        {"spec.scheduling.tolerations": [{"key": "gpu", "operator": "Bogus"}]},
        "tolerations",
        False,
    ),
    "toleration effect": (
        {"spec.scheduling.tolerations": [{"key": "gpu", "operator": "Exists", "effect": "Whatever"}]},
        "tolerations",
        False,
    ),
    "toleration Exists with a value": (
        {"spec.scheduling.tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]},
        "tolerations",
        False,
    ),
    "toleration typo": (
        {"spec.scheduling.tolerations": [{"key": "gpu", "operater": "Exists"}]},
        "operater",
        True,
    ),
    "maxUnavailable over 100%": ({"spec.rollout.maxUnavailable": "150%"}, "maxUnavailable", False),
    "maxSurge 00 with maxUnavailable 0": (
        {"spec.rollout": {"maxSurge": "00", "maxUnavailable": "0"}},
        "maxSurge",
        False,
    ),
    "maxSurge a float": ({"spec.rollout.maxSurge": 1.5}, "maxSurge", False),
    "cpu a float": ({"spec.resources.cpu": 1.5}, "cpu", False),
    "nodeSelector key": ({"spec.scheduling.nodeSelector": {"bad key!": "x"}}, "nodeSelector", False),
    "nodeSelector value too long": ({"spec.scheduling.nodeSelector": {"pool": LONG}}, "nodeSelector", False),
    "nodeSelector value grammar": ({"spec.scheduling.nodeSelector": {"pool": "-x"}}, "nodeSelector", False),
    "priorityClassName": ({"spec.scheduling.priorityClassName": "Not_A_Name"}, "priorityClassName", False),
    "runtimeClassName": ({"spec.scheduling.runtimeClassName": "Bad RC"}, "runtimeClassName", False),
    "serviceAccountName": ({"spec.pod.serviceAccountName": "Bad_SA"}, "serviceAccountName", False),
    "hfTokenSecret": ({"spec.model.hfTokenSecret": "Bad Secret"}, "hfTokenSecret", False),
    "hf revision with ..": (
        {"spec.model": {"source": "hf://org/name@../../x", "cache": {"claimName": "models"}}},
        "source",
        False,
    ),
    "hf org ..": (
        {"spec.model": {"source": "hf://../name", "cache": {"claimName": "models"}}},
        "source",
        False,
    ),
    "extraArgs --port": ({"spec.engine.extraArgs": ["--port", "9000"]}, "extraArgs", False),
    "extraArgs --host=": ({"spec.engine.extraArgs": ["--host=127.0.0.1"]}, "extraArgs", False),
    "extraArgs --admin-port": ({"spec.engine.extraArgs": ["--admin-port", "1"]}, "extraArgs", False),
    "extraArgs --max-num-seqs": ({"spec.engine.extraArgs": ["--max-num-seqs=8"]}, "extraArgs", False),
    "bounds above the field's limit": (
        {"spec.autotune": {"bounds": {"numSpeculativeTokens": [0, 100000]}}},
        "numSpeculativeTokens",
        False,
    ),
    "token bounds above the field's limit": (
        {"spec.autotune": {"bounds": {"maxNumBatchedTokens": [512, 2000000]}}},
        "maxNumBatchedTokens",
        False,
    ),
    "memory 0": ({"spec.resources.memory": "0"}, "memory", False),
    "shmSize 0": ({"spec.resources.shmSize": "0"}, "shmSize", False),
    "cpu 0": ({"spec.resources.cpu": 0}, "cpu", False),
    "cache sizeLimit 0": ({"spec.model.cache": {"sizeLimit": "0Gi"}}, "sizeLimit", False),
    "affinity typo": ({"spec.scheduling.affinity": {"nodeAfinity": {}}}, "nodeAfinity", True),
    "affinity nested typo": (
        {
            "spec.scheduling.affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpression": [{"key": "a", "operator": "In"}]}]
                    }
                }
            }
        },
        "matchExpression",
        True,
    ),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_refused_by_the_crd_and_by_specfleet_up(row: str) -> None:
    changes, field, _ = ROWS[row]
    doc = _with(changes)
    errors = admission_errors(doc)
    assert errors, f"the CRD accepts {row}"
    assert field in " ".join(errors), errors
    with pytest.raises(InvalidInferenceService) as refused:
        load_inference_service(doc)
    assert field in str(refused.value), str(refused.value)


@pytest.mark.parametrize("row", sorted(r for r, (_, _, strict) in ROWS.items() if not strict))
def test_refused_by_the_api_double(fake_kube: FakeKube, row: str) -> None:
    changes, field, _ = ROWS[row]
    fake_kube.rbac = None
    answer: httpx.Response = call(fake_kube, "POST", ISVC_PATH, _with(changes))
    assert answer.status_code == 422, answer.text
    assert field in answer.json()["message"], answer.json()["message"]


def test_the_accepted_neighbours_of_the_rows() -> None:
    """What the rows' rules must keep accepting: each is the valid twin of a refused row."""
    for changes in (
        {"metadata.name": "a" * 55},
        {
            "spec.autotune": {"enabled": True},
            "spec.autoscaling": AUTOSCALED,
            "spec.routing.queueTimeoutSeconds": 60,
        },
        {"spec.scheduling.tolerations": [{"operator": "Exists"}, {"key": "k", "value": "v", "effect": ""}]},
        {
            "spec.scheduling.tolerations": [
                {"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute", "tolerationSeconds": 5}
            ]
        },
        {"spec.rollout": {"maxSurge": "100%", "maxUnavailable": 0}},
        {"spec.rollout": {"maxSurge": "250%", "maxUnavailable": "100%"}},
        {"spec.scheduling.nodeSelector": {"kubernetes.io/arch": "amd64", "pool": "", "a_b.c": "x" * 63}},
        {"spec.scheduling.priorityClassName": "high.priority-1", "spec.pod.serviceAccountName": "engine"},
        {"spec.model": {"source": "hf://org/name@refs/pr/1", "cache": {"claimName": "models"}}},
        {"spec.model": {"source": "hf://org/name..v2@v1.0", "hfTokenSecret": "hf-token"}},
        {"spec.engine.extraArgs": ["--quantized-activations", "float32", "--portable"]},
        {"spec.autotune": {"bounds": {"numSpeculativeTokens": [0, 16]}}},
        {"spec.resources": {"gpus": 0, "cpu": "500m", "memory": "0.5Gi", "shmSize": "64Mi"}},
        {
            "spec.scheduling.affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 10,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"any-key": "v"}},
                            },
                        }
                    ]
                }
            }
        },
    ):
        doc = _with(changes)
        assert admission_errors(doc) == [], changes
        load_inference_service(doc)


def _children(isvc: Any) -> list[dict[str, Any]]:
    """Every object the operator renders for `isvc` (the reconcile's children and the router's)."""
    pdb = render_pdb(isvc)
    return [
        render_service(isvc),
        *([pdb] if pdb else []),
        render_network_policy(isvc, OperatorConfig()),
        render_servicemonitor(isvc),
        *render_engine_workloads(isvc),
        *render_router_children(isvc),
        render_secret(isvc, "t" * 32),
        render_tuned_config(isvc, {}),
    ]


@pytest.mark.parametrize(
    "shape",
    [
        {"spec.replicas": 2},
        {"spec.disaggregation": {}},
        {"spec.engine.nodes": 2, "spec.engine.pipelineParallelSize": 2},
        {"spec.routing.enabled": False, "spec.replicas": 2},
    ],
    ids=["aggregated", "disaggregated", "multi-node", "no-router"],
)
def test_a_name_of_the_longest_admitted_length_fits_every_child(shape: dict[str, Any]) -> None:
    name = "a" * MAX_NAME_LENGTH
    isvc = load_inference_service(_with({"metadata.name": name, **shape}))
    children = _children(isvc)
    names = {c["metadata"]["name"] for c in children}
    if "spec.routing.enabled" not in shape:  # NAME-engines or NAME-prefill: exactly the limit
        assert max(map(len, names)) == DNS1035_LABEL_MAX, names
    too_long = {n for n in names if len(n) > DNS1035_LABEL_MAX or not n.startswith(name)}
    assert not too_long, too_long
    # ... and one character more is refused by both the CRD and the model
    longer = _with({"metadata.name": name + "a", **shape})
    assert "metadata.name" in " ".join(admission_errors(longer))
    with pytest.raises(InvalidInferenceService, match="metadata.name"):
        load_inference_service(longer)


def _flags(args: list[str]) -> set[str]:
    return {a for a in args if a.startswith("--")}


def test_the_reserved_engine_flags_are_those_the_renderer_writes() -> None:
    """engine_flags.OPERATOR_FLAGS is the renderer's flag list: every branch of the engine's command line
    (each role, quantized, split, speculative with a draft, no prefix cache, the live config file)."""
    everything = _with(
        {
            "spec.model.quantization": "int8",
            "spec.engine": {
                "tensorParallelSize": 2,
                "pipelineParallelSize": 2,
                "prefixCaching": False,
                "schedulingPolicy": "priority",
            },
            "spec.resources.gpus": 4,
            "spec.speculative": {
                "method": "draft",
                "disableByBatchSize": 8,
                "draftModel": {"source": "bundled://smollm2-135m-instruct", "quantization": "int8"},
            },
        }
    )
    written: set[str] = set()
    adapters = _with({"spec.adapters": [{"name": "sql", "source": "file:///adapters/sql"}]})
    for doc in (everything, _with({"spec.disaggregation": {}}), adapters):
        isvc = load_inference_service(doc)
        for workload in render_engine_workloads(isvc):
            pod = workload["spec"]["template"]["spec"]
            (engine,) = [c for c in pod["containers"] if c["name"] == ENGINE_CONTAINER]
            written |= _flags(engine["args"])
    assert written == set(OPERATOR_FLAGS)


@pytest.mark.parametrize(
    ("shape", "definition"),
    [
        (AFFINITY, "io.k8s.api.core.v1.Affinity"),
        (TOLERATION, "io.k8s.api.core.v1.Toleration"),
        (TOPOLOGY_SPREAD_CONSTRAINT, "io.k8s.api.core.v1.TopologySpreadConstraint"),
    ],
)
def test_the_shapes_pydantic_checks_are_the_upstream_schemas(shape: Any, definition: str) -> None:
    """kube_grammar's key trees equal the Kubernetes OpenAPI the CRD carries for the same fields."""

    def keys(node: dict[str, Any]) -> Any:
        if "properties" in node:
            return {name: keys(child) for name, child in node["properties"].items()}
        if node.get("type") == "array" and "properties" in node.get("items", {}):
            return (keys(node["items"]),)
        return None

    assert keys(kubernetes_schema(definition)) == shape
