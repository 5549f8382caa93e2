"""Generate the InferenceService CRD from the pydantic models, so the two cannot drift.

    python -m specfleet.operator.crd            # rewrite crds/ and charts/specfleet/crds/
    python -m specfleet.operator.crd --check    # exit 1 if a committed copy is stale

Pydantic's JSON schema is turned into a Kubernetes *structural* schema: `$ref`s are inlined, optional
fields lose their `null` branch, titles are dropped, free-form objects get
`x-kubernetes-preserve-unknown-fields`, and every node keeps its `type`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from .resources import GROUP, KIND, LIST_KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from .spec import InferenceServiceSpec
from .status import InferenceServiceStatus

REPO_ROOT = Path(__file__).resolve().parent.parent
# Every copy the repository ships: the plain CRD, the Helm chart's and the kustomize base's.
CRD_PATHS = (REPO_ROOT / "crds" / "inferenceservice.yaml", REPO_ROOT / "charts" / "specfleet" / "crds" / "inferenceservice.yaml",
             REPO_ROOT / "deploy" / "kustomize" / "base" / "crds" / "inferenceservice.yaml")
_DROP = {"title", "additionalProperties", "prefixItems", "$defs"}

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "True once the rollout is complete: every replica updated and available"},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "K", "type": "integer", "jsonPath": ".status.tuning.numSpeculativeTokens",
     "description": "Speculative tokens per step now in force"},
    {"name": "MaxSeqs", "type": "integer", "jsonPath": ".status.tuning.maxNumSeqs"},
    {"name": "TPOT-p95", "type": "number", "jsonPath": ".status.tuning.observed.tpotP95Ms",
     "description": "Observed time per output token, p95, in ms"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # -o wide (priority 1): the rest of the config in force and the tuner's state, for SREs
    {"name": "ReadyPods", "type": "integer", "jsonPath": ".status.readyReplicas", "priority": 1},
    {"name": "MaxTokens", "type": "integer", "jsonPath": ".status.tuning.maxNumBatchedTokens", "priority": 1,
     "description": "max_num_batched_tokens now in force"},
    {"name": "SpecOffAbove", "type": "integer", "jsonPath": ".status.tuning.speculativeDisableByBatchSize",
     "priority": 1, "description": "Batch size above which a step proposes nothing (0: never)"},
    {"name": "TTFT-p95", "type": "number", "jsonPath": ".status.tuning.observed.ttftP95Ms", "priority": 1,
     "description": "Observed time to first token, p95, in ms"},
    {"name": "Tuned", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Tuned")].reason', "priority": 1,
     "description": "The tuner's last outcome (ConfigChanged, Holding, Idle, Reverted, MetricsUnavailable, ...)"},
    {"name": "LastDecision", "type": "date", "jsonPath": ".status.tuning.lastDecisionTime", "priority": 1},
]
NAME_RULE = {
    "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63",
    "message": "metadata.name must be a DNS-1035 label of at most 63 characters (it names the Service)",
}


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node -> one structural OpenAPI v3 node."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        extras = {k: v for k, v in node.items() if k != "$ref"}
        return structural({**target, **extras}, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} as a structural schema")
        extras = {k: v for k, v in node.items() if k not in ("anyOf", "default") or (k == "default" and v is not None)}
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


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    spec = model_schema(InferenceServiceSpec)
    spec["description"] = "Desired state: the model, the engine, batching, speculation, scheduling, SLO and tuning."
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
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "specfleet"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": LIST_KIND, "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["all", "specfleet"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd_yaml() -> str:
    header = "# Generated by `python -m specfleet.operator.crd` from operator/spec.py and operator/status.py.\n"
    header += "# Do not edit by hand: change the pydantic models and regenerate.\n"
    return header + yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed CRD differs from the models")
    args = parser.parse_args(argv)
    text = render_crd_yaml()
    stale = [p for p in CRD_PATHS if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is stale: run `python -m specfleet.operator.crd` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for path in CRD_PATHS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
