"""What an engine pod asks of a node and where it may run: CPU, memory and GPUs, node selector, tolerations,
affinity, topology spread, priority and runtime class."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from ..kube_grammar import (
    AFFINITY,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_MAX,
    LABEL_VALUE_PATTERN,
    TOLERATION,
    TOPOLOGY_SPREAD_CONSTRAINT,
    toleration_cel,
    toleration_errors,
    unknown_fields,
)
from .fields import OptionalName, PositiveQuantity, _shaped, _Spec, cel, upstream


class ResourcesSpec(_Spec):
    gpus: int = Field(1, ge=0, le=16, description="GPUs per replica; 0 runs the engine on CPU.")
    gpu_resource_name: str = Field("nvidia.com/gpu", pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$", max_length=253)
    cpu: PositiveQuantity = "4"
    memory: PositiveQuantity = "16Gi"
    shm_size: PositiveQuantity = Field("1Gi", description="Size of the in-memory /dev/shm volume.")


def _check_tolerations(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    errors = [
        e
        for i, t in enumerate(value)
        for e in (
            unknown_fields(t, TOLERATION, f"tolerations[{i}]") or toleration_errors(t, f"tolerations[{i}]")
        )
    ]
    if errors:
        raise ValueError("; ".join(errors))
    return value


def _check_label_keys(value: dict[str, str]) -> dict[str, str]:
    if bad := [k for k in value if not re.fullmatch(LABEL_KEY_PATTERN, k)]:
        raise ValueError(f"nodeSelector keys {bad}: {NODE_SELECTOR_KEYS}")
    return value


NODE_SELECTOR_KEYS = (
    "a label key is a name of at most 63 characters (letters, digits, '-', '_', '.'; alphanumeric at both "
    "ends), optionally prefixed by a DNS subdomain and '/'"
)
LabelValue = Annotated[str, Field(max_length=LABEL_VALUE_MAX, pattern=LABEL_VALUE_PATTERN)]


class SchedulingSpec(_Spec):
    node_selector: Annotated[dict[str, LabelValue], AfterValidator(_check_label_keys)] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels the engine pods require (label keys and values, as the Pod's nodeSelector).",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"self.all(k, k.matches('{LABEL_KEY_PATTERN}'))", f"nodeSelector: {NODE_SELECTOR_KEYS}")
            ]
        },
    )
    tolerations: Annotated[list[dict[str, Any]], AfterValidator(_check_tolerations)] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=upstream(
            "io.k8s.api.core.v1.Toleration", **{"x-kubernetes-validations": toleration_cel()}
        ),
    )
    affinity: Annotated[dict[str, Any], _shaped(AFFINITY, "affinity")] = Field(
        default_factory=dict, json_schema_extra=upstream("io.k8s.api.core.v1.Affinity")
    )
    topology_spread_constraints: Annotated[
        list[dict[str, Any]], _shaped((TOPOLOGY_SPREAD_CONSTRAINT,), "topologySpreadConstraints")
    ] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=upstream("io.k8s.api.core.v1.TopologySpreadConstraint"),
    )
    priority_class_name: OptionalName = ""
    runtime_class_name: OptionalName = ""
