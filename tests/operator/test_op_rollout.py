"""Rollouts on a full GPU pool, termination without 503s, model caching and the pod-template passthrough:
the rendered Deployment (valid Kubernetes 1.30, strict), and the CRD and the pydantic model refusing the same
bad objects."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from isvc_schema_tools import REPO, admission_errors, crd_schema, k8s_validate
from specfleet.engine.server.cli import build_parser
from specfleet.operator import InferenceService, InvalidInferenceService, load_inference_service
from specfleet.operator.config import OperatorConfig
from specfleet.operator.render import render_deployment
from specfleet.operator.render.deployment import PRESTOP_SLEEP_SECONDS, termination_grace_seconds
from specfleet.operator.render.model_source import parse_quantity

CONFIG = OperatorConfig(
    engine_image="registry.example/engine:cuda", engine_cpu_image="registry.example/engine:cpu"
)
CPU = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
GPU = yaml.safe_load((REPO / "examples" / "llama3-8b-ngram-gpu.yaml").read_text())


def doc_with(base: dict[str, Any], **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    doc["metadata"].update(namespace="team-a", uid="uid-1", generation=1)
    for dotted, value in spec.items():
        *parents, leaf = dotted.split("__")
        node = doc["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return doc


def rendered(base: dict[str, Any], **spec: Any) -> dict[str, Any]:
    isvc: InferenceService = load_inference_service(doc_with(base, **spec))
    deployment = render_deployment(isvc, CONFIG)
    k8s_validate(deployment)
    return deployment


def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def refused(doc: dict[str, Any], mentioned: str) -> None:
    """Both the API server (schema + CEL) and the pydantic model refuse `doc`, naming `mentioned`."""
    errors = admission_errors(doc)
    assert errors and mentioned in " ".join(errors), errors
    with pytest.raises(InvalidInferenceService, match=mentioned):
        load_inference_service(doc)


def accepted(doc: dict[str, Any]) -> None:
    assert admission_errors(doc) == []
    load_inference_service(doc)


# -- strategy ---------------------------------------------------------------------------------------------


def test_gpu_pods_default_to_a_rollout_that_needs_no_spare_gpu() -> None:
    """maxSurge 1 on a pool without a free GPU leaves the surge pod Pending until the progress deadline."""
    assert rendered(GPU)["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert rendered(CPU)["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ({"strategy": "Recreate"}, {"type": "Recreate"}),
        (
            {"maxSurge": "25%", "maxUnavailable": "25%"},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
        ),
        ({"maxSurge": 2}, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 2, "maxUnavailable": 1}}),
        # a GPU default would make both 0 next to the user's 0: the other one becomes 1
        (
            {"maxUnavailable": 0},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        ),
    ],
)
def test_spec_rollout_reaches_the_deployment(rollout: dict[str, Any], expected: dict[str, Any]) -> None:
    assert rendered(GPU, rollout=rollout)["spec"]["strategy"] == expected


@pytest.mark.parametrize(
    ("rollout", "mentioned"),
    [
        ({"maxSurge": 0, "maxUnavailable": "0%"}, "cannot both be 0"),
        ({"strategy": "Recreate", "maxSurge": 1}, "RollingUpdate only"),
        ({"strategy": "BlueGreen"}, "BlueGreen"),
        ({"maxSurge": "-1"}, "maxSurge"),
        ({"maxUnavailable": "10 %"}, "maxUnavailable"),
    ],
)
def test_bad_rollouts_are_refused_at_admission(rollout: dict[str, Any], mentioned: str) -> None:
    refused(doc_with(GPU, rollout=rollout), mentioned)


# -- termination ------------------------------------------------------------------------------------------


def test_termination_order_and_grace_period() -> None:
    deployment = rendered(CPU, engine__drainTimeoutSeconds=45)
    spec = pod(deployment)
    container = spec["containers"][0]
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}
    args = build_parser().parse_args(container["args"])  # the engine's own parser reads the flags back
    assert args.drain_timeout == 45 and args.shutdown_delay > 0
    # SIGKILL only after the preStop sleep, the shutdown delay and the whole drain
    isvc = load_inference_service(doc_with(CPU, engine__drainTimeoutSeconds=45))
    assert spec["terminationGracePeriodSeconds"] == termination_grace_seconds(isvc.spec)
    assert spec["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_SECONDS + args.shutdown_delay + 45
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # fails at SIGTERM (tests/server)


# -- GPUs the engine does not use -------------------------------------------------------------------------


def test_gpus_above_what_the_engine_uses_are_refused() -> None:
    refused(doc_with(GPU, resources__gpus=2), "resources.gpus")
    accepted(doc_with(GPU, resources__gpus=1))
    accepted(doc_with(CPU, resources__gpus=0))


# -- model cache ------------------------------------------------------------------------------------------


def test_hf_downloads_get_a_bounded_requested_volume() -> None:
    deployment = rendered(GPU, model__cache={"sizeLimit": "30Gi"})
    spec = pod(deployment)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model-download"]["emptyDir"] == {"sizeLimit": "30Gi"}
    assert spec["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "30Gi"
    # the default applies without a cache setting
    assert pod(rendered(GPU))["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "40Gi"
    # no download, no request
    assert "ephemeral-storage" not in pod(rendered(CPU))["containers"][0]["resources"]["requests"]


def test_hf_target_and_draft_downloads_add_up() -> None:
    spec = pod(
        rendered(
            GPU,
            model__cache={"sizeLimit": "10Gi"},
            speculative={
                "method": "draft",
                "draftModel": {"source": "hf://meta-llama/Llama-3.2-1B-Instruct"},
            },
        )
    )
    assert spec["containers"][0]["resources"]["requests"]["ephemeral-storage"] == str(2 * 10 * 2**30)


def test_a_shared_cache_claim_is_downloaded_into_once_and_read_only_by_the_engine() -> None:
    spec = pod(
        rendered(
            GPU,
            model__source="hf://meta-llama/Meta-Llama-3-8B-Instruct@v2",
            model__cache={"claimName": "model-cache"},
        )
    )
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model-download"] == {
        "name": "model-download",
        "persistentVolumeClaim": {"claimName": "model-cache"},
    }
    (init,) = spec["initContainers"]
    assert init["command"][-3:] == [
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "v2",
        "/hf-cache/meta-llama/Meta-Llama-3-8B-Instruct/v2",
    ]
    assert {"name": "model-download", "mountPath": "/hf-cache"} in init["volumeMounts"]
    engine = spec["containers"][0]
    mount = next(m for m in engine["volumeMounts"] if m["name"] == "model-download")
    assert mount == {
        "name": "model-download",
        "mountPath": "/models/model",
        "readOnly": True,
        "subPath": "meta-llama/Meta-Llama-3-8B-Instruct/v2",
    }
    assert "ephemeral-storage" not in engine["resources"]["requests"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("40Gi", 40 * 2**30),
        ("1.5G", 1_500_000_000),
        ("500m", 1),
        ("1e3", 1000),
        ("2E1", 20),
        (".5Ki", 512),
        ("7", 7),
    ],
)
def test_quantities_parse_as_kubernetes_counts_them(text: str, value: int) -> None:
    assert parse_quantity(text) == value


# -- quantity grammar -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["-16Gi", "1Gii", "1.2.3", "16 Gi", "Gi", "1e", "0x10", "1.5gi", "", "+-1"])
def test_quantities_use_the_kubernetes_grammar(bad: str) -> None:
    refused(doc_with(CPU, resources__memory=bad), "memory")


@pytest.mark.parametrize(
    "good", ["16Gi", "500m", "1.5", ".5", "1e3", "1E-3", "+4", "4.", "2k", "1Ei", "100u"]
)
def test_valid_quantities_pass(good: str) -> None:
    accepted(doc_with(CPU, resources__memory=good))


def test_integer_quantities_are_not_negative() -> None:
    refused(doc_with(CPU, resources__cpu=-2), "cpu")
    accepted(doc_with(CPU, resources__cpu=2))


# -- upstream schemas -------------------------------------------------------------------------------------


def test_tolerations_and_affinity_use_the_kubernetes_schemas() -> None:
    spec = crd_schema()["properties"]["spec"]["properties"]
    toleration = spec["scheduling"]["properties"]["tolerations"]["items"]
    assert set(toleration["properties"]) == {"key", "operator", "value", "effect", "tolerationSeconds"}
    affinity = spec["scheduling"]["properties"]["affinity"]
    assert set(affinity["properties"]) == {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    assert "x-kubernetes-preserve-unknown-fields" not in affinity
    errors = admission_errors(doc_with(CPU, scheduling__tolerations=[{"key": "gpu", "operater": "Exists"}]))
    assert any("operater" in e for e in errors), errors
    errors = admission_errors(doc_with(CPU, scheduling__affinity={"nodeAffinity": {"required": []}}))
    assert any("required" in e for e in errors), errors
    errors = admission_errors(
        doc_with(CPU, scheduling__tolerations=[{"key": "gpu", "tolerationSeconds": "soon"}])
    )
    assert any("soon" in e for e in errors), errors


# -- pod template passthrough -----------------------------------------------------------------------------

PASSTHROUGH = {
    "serviceAccountName": "inference",
    "automountServiceAccountToken": True,
    "imagePullSecrets": [{"name": "registry-creds"}],
    "labels": {"team": "search", "app.kubernetes.io/instance": "hijack"},
    "annotations": {"sidecar.istio.io/inject": "false"},
    "env": [
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "engine-settings"}}],
    "volumes": [{"name": "certs", "secret": {"secretName": "internal-ca"}}],
    "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/internal", "readOnly": True}],
}
SPREAD = [
    {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"serving.specfleet.io/inferenceservice": "llama3-8b-ngram"}},
    }
]


def test_pod_template_passthrough_reaches_the_pod() -> None:
    doc = doc_with(
        GPU,
        pod=PASSTHROUGH,
        scheduling__topologySpreadConstraints=SPREAD,
        scheduling__priorityClassName="inference-high",
    )
    accepted(doc)
    deployment = rendered(
        GPU,
        pod=PASSTHROUGH,
        scheduling__topologySpreadConstraints=SPREAD,
        scheduling__priorityClassName="inference-high",
    )
    template = deployment["spec"]["template"]
    spec, engine = template["spec"], template["spec"]["containers"][0]
    assert spec["serviceAccountName"] == "inference" and spec["automountServiceAccountToken"] is True
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert spec["priorityClassName"] == "inference-high" and spec["topologySpreadConstraints"] == SPREAD
    assert template["metadata"]["labels"]["team"] == "search"
    # the operator's labels win: the Deployment's selector and the Service keep finding the pods
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == deployment["metadata"]["name"]
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    env = [e["name"] for e in engine["env"]]
    assert env[:2] == ["NCCL_DEBUG", "POD_IP"] and "SPECFLEET_ADMIN_TOKEN_FILE" in env
    assert engine["envFrom"] == [{"configMapRef": {"name": "engine-settings"}}]
    assert {"name": "certs", "secret": {"secretName": "internal-ca"}} in spec["volumes"]
    assert {"name": "certs", "mountPath": "/etc/ssl/internal", "readOnly": True} in engine["volumeMounts"]


def test_without_passthrough_the_pod_keeps_its_defaults() -> None:
    spec = pod(rendered(GPU))
    assert spec["automountServiceAccountToken"] is False
    assert not {"serviceAccountName", "imagePullSecrets", "topologySpreadConstraints"} & set(spec)
    assert "envFrom" not in spec["containers"][0]


@pytest.mark.parametrize(
    ("pod_fields", "mentioned"),
    [
        ({"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}, "HF_HUB_OFFLINE"),
        ({"volumes": [{"name": "cache", "emptyDir": {}}]}, "cache"),
        ({"volumes": [{"name": "model-weights", "emptyDir": {}}]}, "model-"),
        ({"volumeMounts": [{"name": "x", "mountPath": "/models/model"}]}, "/models/model"),
        ({"serviceAcountName": "typo"}, "serviceAcountName"),
    ],
)
def test_pod_template_entries_that_clash_with_the_operators_are_refused(
    pod_fields: dict[str, Any], mentioned: str
) -> None:
    refused(doc_with(GPU, pod=pod_fields), mentioned)


@pytest.mark.parametrize(
    ("pod_fields", "mentioned"),
    [
        ({"env": [{"value": "no name"}]}, "name"),
        ({"volumes": [{"name": "data", "hostPth": {"path": "/data"}}]}, "hostPth"),
        ({"imagePullSecrets": [{"name": 7}]}, "7"),
    ],
)
def test_malformed_upstream_objects_are_refused_by_the_api_server(
    pod_fields: dict[str, Any], mentioned: str
) -> None:
    """The upstream schemas bind at admission; the pydantic model (for `specfleet up`, which runs no pods)
    keeps these fields as plain objects."""
    errors = admission_errors(doc_with(GPU, pod=pod_fields))
    assert errors and mentioned in " ".join(errors), errors
