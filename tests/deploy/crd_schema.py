"""Validate an object against a CustomResourceDefinition's schema the way the API server's strict field
validation would: the served version's openAPIV3Schema, unknown fields rejected except under
x-kubernetes-preserve-unknown-fields, int-or-string accepted as either."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if "items" in out:
        out["items"] = _strict(out["items"])
    return out


def crd_errors(crd_path: Path, obj: dict[str, Any]) -> list[str]:
    crd = yaml.safe_load(crd_path.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    api_group, version = obj["apiVersion"].rsplit("/", 1)
    if (api_group, obj["kind"]) != (group, kind):
        return [f"{obj['apiVersion']} {obj['kind']} is not {group} {kind}"]
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        return [f"{version} is not served by {crd_path.name} (served: {sorted(served)})"]
    schema = _strict(served[version]["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)
    ]
