"""The CRD: generated from the pydantic models (tests/test_generated.py checks the committed copies), valid for
Kubernetes, and enforcing the same rules."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from isvc_schema_tools import EXAMPLES, admission_errors, apply_defaults, crd_schema, k8s_validate, load_crd
from specfleet.operator import InvalidInferenceService, load_inference_service
from specfleet.operator.spec import InferenceServiceSpec


def test_crd_is_a_valid_kubernetes_object() -> None:
    k8s_validate(load_crd())


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Structural-schema violations: a node without a type (unless int-or-string / preserve-unknown)."""
    bad = []
    if (
        "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        bad.append(path or "<root>")
    for key in ("$ref", "anyOf", "oneOf", "allOf"):
        if key in node:
            bad.append(f"{path}:{key}")
    for name, child in node.get("properties", {}).items():
        bad += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


def test_schema_is_structural() -> None:
    assert _walk(crd_schema()) == []


def test_names_subresources_and_printer_columns() -> None:
    spec = load_crd()["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["shortNames"]) == (
        "serving.specfleet.io",
        "Namespaced",
        ["isvc"],
    )
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert version["subresources"]["scale"]["statusReplicasPath"] == ".status.replicas"
    assert "status" in version["subresources"]
    names = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0]
    assert names == [
        "Model",
        "Replicas",
        "Ready",
        "Reason",
        "K",
        "MaxSeqs",
        "TPOT-p95",
        "Age",
    ]  # -o wide: test_op_printer_columns
    tuning = crd_schema()["properties"]["status"]["properties"]["tuning"]["properties"]
    assert {
        "numSpeculativeTokens",
        "maxNumSeqs",
        "maxNumBatchedTokens",
        "speculativeDisableByBatchSize",
        "lastDecisionTime",
        "reason",
    } <= set(tuning)
    assert set(tuning["observed"]["properties"]) == {
        "acceptanceRate",
        "ttftP95Ms",
        "tpotP95Ms",
        "goodput",
        "requestRate",
    }


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_empty(v) for k, v in value.items() if v not in ({}, [], None)}
    return value


def test_api_server_defaults_equal_pydantic_defaults() -> None:
    minimal = {"model": {"source": "bundled://smollm2-135m-instruct"}}
    defaulted = apply_defaults(crd_schema()["properties"]["spec"], minimal)
    assert defaulted == _drop_empty(InferenceServiceSpec.model_validate(minimal).model_dump(by_alias=True))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_crd_and_the_model(path: Any) -> None:
    doc = yaml.safe_load(path.read_text())
    assert admission_errors(doc) == []
    load_inference_service(path)


CPU = yaml.safe_load((EXAMPLES[0].parent / "smollm2-cpu.yaml").read_text())
AUTOTUNE = {"enabled": True}


def _with(changes: dict[str, Any], base: dict[str, Any] = CPU) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


_DELETE = object()
INVALID = {
    "negative replicas": ({"spec.replicas": -1}, "replicas"),
    "draft without draftModel": ({"spec.speculative.method": "draft"}, "draftModel"),
    "draftModel without draft": (
        {
            "spec.speculative.method": "ngram",
            "spec.speculative.draftModel": {"source": "bundled://smollm2-135m-instruct"},
        },
        "draftModel",
    ),
    "bounds min > max": (
        {"spec.autotune": {"enabled": True, "bounds": {"numSpeculativeTokens": [8, 2]}}},
        "numSpeculativeTokens",
    ),
    "k outside bounds": (
        {
            "spec.speculative.method": "ngram",
            "spec.speculative.numSpeculativeTokens": 10,
            "spec.autotune": AUTOTUNE,
        },
        "numSpeculativeTokens",
    ),
    "maxNumSeqs outside bounds": (
        {
            "spec.batching.maxNumSeqs": 300,
            "spec.batching.maxNumBatchedTokens": 4096,
            "spec.autotune": AUTOTUNE,
        },
        "maxNumSeqs",
    ),
    "token budget below seqs": (
        {"spec.batching": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}},
        "maxNumBatchedTokens",
    ),
    "gpus not tp x pp": (
        {"spec.engine.tensorParallelSize": 2, "spec.resources.gpus": 1},
        "resources.gpus must be 0",
    ),
    "gguf under tensor parallelism": (
        {"spec.engine.tensorParallelSize": 3, "spec.resources.gpus": 3, "spec.model.quantization": "gguf"},
        "tensorParallelSize must be 1",
    ),
    "unknown method": ({"spec.speculative.method": "medusa"}, "medusa"),
    "block size not a power of two": ({"spec.engine.blockSize": 24}, "24"),
    "unsupported source scheme": ({"spec.model.source": "s3://bucket/model"}, "s3://"),
    "missing model": ({"spec.model": _DELETE}, "model"),
    "kv fraction above 1": ({"spec.engine.kvCacheMemoryFraction": 1.5}, "1.5"),
    "cpu not a quantity": ({"spec.resources.cpu": "lots"}, "lots"),
    "name not a DNS label": ({"metadata.name": "Bad_Name"}, "name"),
    "misspelled field": ({"spec.speculative.k": 4}, "k"),
    "autoscaling min > max": ({"spec.autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas"),
    "autoscaling without autotune": ({"spec.autoscaling": {"enabled": True, "maxReplicas": 2}}, "autotune"),
    "unknown routing policy": ({"spec.routing.policy": "random"}, "random"),
    "routing weight above its bound": ({"spec.routing.weight": 1001}, "weight"),
    "negative routing weight": ({"spec.routing.weight": -1}, "weight"),
    "repeated alias": ({"spec.routing.aliases": ["llm", "chat", "llm"]}, "must not repeat"),
    "alias with a space": ({"spec.routing.aliases": ["my model"]}, "aliases"),
    "bounds with three numbers": ({"spec.autotune": {"bounds": {"maxNumSeqs": [1, 2, 3]}}}, "maxNumSeqs"),
    "pin outside bounds": (
        {"spec.autotune": {"pins": {"maxNumSeqs": 300}, "bounds": {"maxNumSeqs": [4, 64]}}},
        "pins.maxNumSeqs",
    ),
    "pin below the knob's minimum": ({"spec.autotune": {"pins": {"maxNumSeqs": 0}}}, "maxNumSeqs"),
    "disaggregation with a split model": (
        {"spec.disaggregation": {}, "spec.engine.tensorParallelSize": 3, "spec.resources.gpus": 3},
        "KV connector moves one process's cache",
    ),
    "disaggregation without the router": (
        {"spec.disaggregation": {}, "spec.routing.enabled": False},
        "needs routing.enabled",
    ),
    "disaggregation with spec.replicas": (
        {"spec.disaggregation": {}, "spec.replicas": 3},
        "leave spec.replicas at 1",
    ),
    "disaggregation role with 0 replicas": (
        {"spec.disaggregation": {"prefill": {"replicas": 0}}},
        "replicas",
    ),
    "adapter named twice": (
        {"spec.adapters": [{"name": "sql", "source": "file:///a"}, {"name": "sql", "source": "file:///b"}]},
        "each name at most once",
    ),
    "adapter rank above maxLoraRank": (
        {"spec.adapters": [{"name": "sql", "source": "file:///a", "rank": 128}]},
        "maxLoraRank",
    ),
    "adapters on a split model": (
        {
            "spec.adapters": [{"name": "sql", "source": "file:///a"}],
            "spec.engine.tensorParallelSize": 2,
            "spec.resources.gpus": 2,
        },
        "adapters need engine.tensorParallelSize",
    ),
    "adapter from bundled://": ({"spec.adapters": [{"name": "sql", "source": "bundled://x"}]}, "source"),
    "nodes without pipeline stages": ({"spec.engine.nodes": 2}, "engine.nodes > 1 spreads pipeline stages"),
    "nodes not dividing the stages": (
        {"spec.engine.nodes": 2, "spec.engine.pipelineParallelSize": 3, "spec.resources.gpus": 0},
        "a multiple of nodes",
    ),
    "gpus of the whole group on each node": (
        {"spec.engine.nodes": 2, "spec.engine.pipelineParallelSize": 4, "spec.resources.gpus": 4},
        "resources.gpus must be 0",
    ),
    "nodes with disaggregation": (
        {
            "spec.engine.nodes": 2,
            "spec.engine.pipelineParallelSize": 2,
            "spec.resources.gpus": 1,
            "spec.disaggregation": {},
        },
        "nodes 1",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_inference_services_are_rejected_by_crd_and_model(case: str) -> None:
    changes, mentioned = INVALID[case]
    doc = _with(changes)
    errors = admission_errors(doc)
    assert errors, f"the CRD accepted {case}"
    assert mentioned in " ".join(errors), errors
    with pytest.raises(InvalidInferenceService, match="not a valid InferenceService"):
        load_inference_service(doc)


def test_bounds_only_bind_when_autotune_is_on() -> None:
    doc = _with({"spec.speculative.method": "ngram", "spec.speculative.numSpeculativeTokens": 12})
    assert admission_errors(doc) == []
    assert load_inference_service(doc).spec.speculative.num_speculative_tokens == 12


def _accepted_by_model(doc: dict[str, Any]) -> bool:
    """What the operator and `specfleet up` run: the model validates."""
    try:
        load_inference_service(doc)
    except InvalidInferenceService:
        return False
    return True


def test_disaggregation_is_accepted_by_the_cluster_and_by_specfleet_up() -> None:
    """The same YAML: admission (schema, defaults, CEL) and the pydantic model `specfleet up` loads."""
    doc = _with({"spec.disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}})
    assert admission_errors(doc) == []
    spec = load_inference_service(doc).spec
    assert spec.disaggregation is not None and spec.disaggregation.decode.replicas == 2
    defaulted = apply_defaults(crd_schema(), _with({"spec.disaggregation": {}}))
    assert defaulted["spec"]["disaggregation"] == {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def test_routing_weight_and_aliases_are_accepted_by_the_cluster_and_by_specfleet_up() -> None:
    """A canary's fields: the API server defaults the weight to the model's default, and both accept
    model names as clients write them."""
    doc = _with(
        {"spec.routing.aliases": ["llama", "meta-llama/Llama-3.1-8B", "llama:v2"], "spec.routing.weight": 5}
    )
    assert admission_errors(doc) == []
    routing = load_inference_service(doc).spec.routing
    assert (routing.weight, routing.aliases) == (5, ["llama", "meta-llama/Llama-3.1-8B", "llama:v2"])
    defaulted = apply_defaults(crd_schema(), _with({}))
    assert defaulted["spec"]["routing"]["weight"] == load_inference_service(CPU).spec.routing.weight == 100


@settings(max_examples=60, deadline=None)
@given(
    replicas=st.integers(-1, 3),
    seqs=st.integers(1, 400),
    tokens=st.sampled_from([16, 64, 512, 8192, 9000]),
    k=st.integers(0, 12),
    method=st.sampled_from(["none", "ngram", "draft"]),
    draft=st.booleans(),
    autotune=st.booleans(),
    k_bounds=st.tuples(st.integers(0, 10), st.integers(0, 10)),
    tp=st.integers(1, 3),
    pp=st.integers(1, 4),
    nodes=st.integers(1, 3),
    gpus=st.integers(0, 4),
    scaling=st.tuples(st.booleans(), st.integers(0, 3), st.integers(1, 3)),
    disaggregated=st.booleans(),
    routing=st.booleans(),
)
def test_crd_and_model_agree_on_cross_field_rules(
    replicas: int,
    seqs: int,
    tokens: int,
    k: int,
    method: str,
    draft: bool,
    autotune: bool,
    k_bounds: tuple[int, int],
    tp: int,
    pp: int,
    nodes: int,
    gpus: int,
    scaling: tuple[bool, int, int],
    disaggregated: bool,
    routing: bool,
) -> None:
    changes: dict[str, Any] = {
        "spec.replicas": replicas,
        "spec.batching": {"maxNumSeqs": seqs, "maxNumBatchedTokens": tokens},
        "spec.speculative": {
            "method": method,
            "numSpeculativeTokens": k,
            **({"draftModel": {"source": "bundled://smollm2-135m-instruct"}} if draft else {}),
        },
        "spec.autotune": {"enabled": autotune, "bounds": {"numSpeculativeTokens": list(k_bounds)}},
        "spec.engine.tensorParallelSize": tp,
        "spec.engine.pipelineParallelSize": pp,
        "spec.engine.nodes": nodes,
        "spec.routing.enabled": routing,
        "spec.resources.gpus": gpus,
        "spec.autoscaling": {"enabled": scaling[0], "minReplicas": scaling[1], "maxReplicas": scaling[2]},
        "spec.disaggregation": {"prefill": {"replicas": 1}} if disaggregated else _DELETE,
    }
    doc = _with(changes)
    assert (admission_errors(doc) == []) == _accepted_by_model(doc)


def test_tensor_and_pipeline_parallelism_together_with_int8_are_accepted() -> None:
    doc = _with(
        {
            "spec.engine.tensorParallelSize": 2,
            "spec.engine.pipelineParallelSize": 2,
            "spec.resources.gpus": 4,
            "spec.model.quantization": "int8",
        }
    )
    assert admission_errors(doc) == []
    engine = load_inference_service(doc).spec.engine
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size) == (2, 2)
