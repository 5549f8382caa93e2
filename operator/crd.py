"""Render the InferenceService CRD from the pydantic models, so the two cannot drift.

`python -m specfleet.operator.generate` writes it to crds/, the kustomize base and the chart's
templates/crd.yaml (with every other derived file); `--check` fails on a stale copy.

Pydantic's JSON schema is turned into a Kubernetes *structural* schema: `$ref`s are inlined, optional
fields lose their `null` branch, titles are dropped, free-form objects get
`x-kubernetes-preserve-unknown-fields`, and every node keeps its `type`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from .inference_service import NAME_PATTERN
from .resources import (
    DNS1035_LABEL_MAX,
    GROUP,
    KIND,
    LIST_KIND,
    LONGEST_CHILD_SUFFIX,
    MAX_NAME_LENGTH,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from .spec import K8S_SCHEMA_KEY, InferenceServiceSpec
from .status import InferenceServiceStatus

_DROP = {"title", "additionalProperties", "prefixItems", "$defs"}

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "True once the rollout is complete: every replica updated and available",
    },
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {
        "name": "K",
        "type": "integer",
        "jsonPath": ".status.tuning.numSpeculativeTokens",
        "description": "Speculative tokens per step now in force",
    },
    {"name": "MaxSeqs", "type": "integer", "jsonPath": ".status.tuning.maxNumSeqs"},
    {
        "name": "TPOT-p95",
        "type": "number",
        "jsonPath": ".status.tuning.observed.tpotP95Ms",
        "description": "Observed time per output token, p95, in ms",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # -o wide (priority 1): the rest of the config in force and the tuner's state, for SREs
    {"name": "ReadyPods", "type": "integer", "jsonPath": ".status.readyReplicas", "priority": 1},
    {
        "name": "MaxTokens",
        "type": "integer",
        "jsonPath": ".status.tuning.maxNumBatchedTokens",
        "priority": 1,
        "description": "max_num_batched_tokens now in force",
    },
    {
        "name": "SpecOffAbove",
        "type": "integer",
        "jsonPath": ".status.tuning.speculativeDisableByBatchSize",
        "priority": 1,
        "description": "Batch size above which a step proposes nothing (0: never)",
    },
    {
        "name": "TTFT-p95",
        "type": "number",
        "jsonPath": ".status.tuning.observed.ttftP95Ms",
        "priority": 1,
        "description": "Observed time to first token, p95, in ms",
    },
    {
        "name": "Tuned",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Tuned")].reason',
        "priority": 1,
        "description": "The tuner's last outcome (ConfigChanged, Holding, Idle, Reverted, MetricsUnavailable, ...)",
    },
    {"name": "LastDecision", "type": "date", "jsonPath": ".status.tuning.lastDecisionTime", "priority": 1},
]
NAME_RULE = {
    "rule": f"self.metadata.name.matches('{NAME_PATTERN}') && size(self.metadata.name) <= {MAX_NAME_LENGTH}",
    "message": f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters: it names "
    f"the Service, and the longest child name, NAME{LONGEST_CHILD_SUFFIX}, must fit in {DNS1035_LABEL_MAX}",
}


# Where the Kubernetes OpenAPI comes from: the JSON schemas kubernetes-validate ships (a test dependency; the
# CRD is generated at development time), for the oldest Kubernetes we support.
KUBERNETES_SCHEMA_VERSION = "v1.30.0-local"
_KEEP_X = {
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
}
_FREE_FORM = {"io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}  # embedded metadata: not validated nested
_INT_OR_STRING = {
    "io.k8s.apimachinery.pkg.api.resource.Quantity",
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString",
}


def _kubernetes_definitions() -> dict[str, Any]:
    import json

    import kubernetes_validate

    path = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / KUBERNETES_SCHEMA_VERSION
        / "_definitions.json"
    )
    return json.loads(path.read_text())["$defs"]


def kubernetes_schema(name: str, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Kubernetes OpenAPI definition (`io.k8s.api.core.v1.Toleration`) as a structural schema: refs
    inlined, `[type, null]` unions narrowed, quantities int-or-string, descriptions dropped (the CRD stays
    small; `kubectl explain` links the upstream type by its field description)."""
    defs = _kubernetes_definitions() if defs is None else defs
    if name in _FREE_FORM:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if name in _INT_OR_STRING:
        return {"x-kubernetes-int-or-string": True}
    return _upstream_node(defs[name], defs)


def _upstream_node(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        return kubernetes_schema(node["$ref"].rsplit("/", 1)[-1], defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            kinds = [value] if isinstance(value, str) else [k for k in value if k != "null"]
            out["type"] = kinds[0]
        elif key == "properties":
            out["properties"] = {name: _upstream_node(child, defs) for name, child in value.items()}
        elif key == "items":
            out["items"] = _upstream_node(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out["additionalProperties"] = _upstream_node(value, defs)
        elif key in ("required", "enum", "format", "default") or key in _KEEP_X:
            out[key] = value
    return out


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node -> one structural OpenAPI v3 node."""
    if K8S_SCHEMA_KEY in node:
        upstream = kubernetes_schema(node[K8S_SCHEMA_KEY])
        kept = {
            k: v
            for k, v in node.items()
            if k in ("description", "maxItems", "type", "x-kubernetes-validations")
        }
        if node.get("type") == "array":
            return {**kept, "items": upstream}
        return {**upstream, **{k: v for k, v in kept.items() if k != "type"}}
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        extras = {k: v for k, v in node.items() if k != "$ref"}
        return structural({**target, **extras}, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} as a structural schema")
        extras = {
            k: v
            for k, v in node.items()
            if k not in ("anyOf", "default") or (k == "default" and v is not None)
        }
        return structural({**branches[0], **extras}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out["properties"] = {name: structural(child, defs) for name, child in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs)
        elif key == "enum" and "type" not in node:
            out["enum"] = value
            out["type"] = "integer" if all(isinstance(v, int) for v in value) else "string"
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    elif out.get("type") == "object" and "properties" not in out:
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    spec = model_schema(InferenceServiceSpec)
    spec["description"] = (
        "Desired state: the model, the engine, batching, speculation, scheduling, SLO and tuning."
    )
    status = model_schema(InferenceServiceStatus)
    status["description"] = "Observed state, written by the operator and the tuner; never by users."
    root = {
        "type": "object",
        "required": ["spec"],
        "x-kubernetes-validations": [NAME_RULE],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "specfleet"},
            "annotations": dict(GITOPS_KEEP),
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": LIST_KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "specfleet"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


# Deleting the CRD deletes every InferenceService in the cluster, in every namespace: no GitOps tool may do
# it for a manifest that left Git (Argo CD's prune, Flux's prune: `crds.install=false`, a kustomize base
# dropped) or for an Application/Kustomization deleted. Argo CD honours Helm's keep policy only as
# Delete=false (2.8+), never as Prune=false; Flux's kustomize-controller honours neither.
GITOPS_KEEP = {
    "argocd.argoproj.io/sync-options": "Prune=false,Delete=false",
    "kustomize.toolkit.fluxcd.io/prune": "disabled",
}

_HEADER = (
    "# Generated by `python -m specfleet.operator.generate` from operator/spec/ and operator/status.py.\n"
    "# Do not edit by hand: change the pydantic models and regenerate.\n"
)


def render_crd_yaml() -> str:
    return _HEADER + yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def render_chart_crd_template() -> str:
    """The chart's `templates/crd.yaml`: the same CRD, between Helm guards (nothing in it may look like a
    template action)."""
    crd = build_crd()
    kept = {"helm.sh/resource-policy": "keep", **crd["metadata"].pop("annotations")}
    body = yaml.dump(crd, Dumper=_NoAliasDumper, sort_keys=False, width=120)
    if "{{" in body or "}}" in body:
        raise ValueError("the CRD contains '{{' or '}}', which Helm would read as a template action")
    labels = "    app.kubernetes.io/part-of: specfleet\n"
    if labels not in body:
        raise ValueError("the CRD's metadata.labels changed: update render_chart_crd_template")
    keep = (
        "  {{- if .Values.crds.keep }}\n  annotations:\n    # neither `helm uninstall` nor a GitOps tool may delete "
        "every InferenceService with the CRD\n"
        + "".join(f"    {key}: {value}\n" for key, value in kept.items())
        + "  {{- end }}\n"
    )
    body = body.replace(labels, labels + keep, 1)
    return _HEADER + "{{- if .Values.crds.install }}\n" + body + "{{- end }}\n"


if __name__ == "__main__":
    sys.exit("the CRD is written by `python -m specfleet.operator.generate` (with every other derived file)")
