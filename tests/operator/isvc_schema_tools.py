"""Test helpers: the CRD's own schema as the API server would apply it (defaults, schema, CEL rules),
and upstream Kubernetes schema validation pinned to one Kubernetes version."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kube_admission import (  # tests/ is on sys.path (rootdir conftest)
    apply_defaults,
    cel_errors,
    int_or_string,
)

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferenceservice.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
KUBERNETES_VERSION = (
    "1.30.0"  # the oldest Kubernetes we support; CEL and PDB unhealthyPodEvictionPolicy are GA
)


@functools.cache
def _crd_text() -> str:
    return CRD_PATH.read_text()


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(_crd_text())


def crd_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def k8s_validate(obj: dict[str, Any]) -> None:
    """Raises kubernetes_validate.ValidationError if obj is not valid for KUBERNETES_VERSION (strict:
    unknown fields are errors too)."""
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Unknown fields rejected, as kubectl's default server-side field validation (Strict) does."""
    out = copy.deepcopy(schema)
    if "properties" in out and out is not None and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = _strict(out["items"])
    return out


@functools.cache
def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(int_or_string(_strict(crd_schema())))


def schema_errors(obj: dict[str, Any]) -> list[str]:
    validator = _validator()
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def admission_errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would say about creating obj: schema errors first, then CEL rules."""
    schema = _validator().schema
    defaulted = apply_defaults(schema, obj)
    errors = schema_errors(defaulted)
    return errors or cel_errors(schema, defaulted)
