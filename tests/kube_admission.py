"""What the API server does to a custom resource before storing it, from the CRD's structural schema:
defaulting, pruning of unknown fields, schema validation and the CEL rules (`x-kubernetes-validations`,
evaluated with cel-python). Shared by the CRD tests and the fake API server (tests/fake_kube.py).
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: fill missing properties that have a default."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def prune(schema: dict[str, Any], value: Any, top: bool = True) -> Any:
    """Drop fields the schema does not declare (kopf's `status.kopf` disappears this way). `metadata`,
    `apiVersion` and `kind` at the top are the server's, never pruned."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties")
            return {k: prune(extra, v, False) for k, v in value.items()} if isinstance(extra, dict) else value
        kept = {k: prune(props[k], v, False) for k, v in value.items() if k in props}
        if top:
            kept.update({k: value[k] for k in ("apiVersion", "kind", "metadata") if k in value})
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], item, False) for item in value]
    return value


def int_or_string(schema: dict[str, Any]) -> dict[str, Any]:
    """`x-kubernetes-int-or-string` as the API server reads it: an integer or a string, never a float
    (JSON Schema does not know the extension, so a float would pass)."""
    # every dict below is a schema or a map of them (properties): both recurse the same way
    out = {k: int_or_string(v) if isinstance(v, dict) else v for k, v in schema.items()}
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def schema_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(
        int_or_string({k: v for k, v in schema.items() if not k.startswith("x-kubernetes")})
    )
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)
    ]


def _evaluate(rule: str, value: Any) -> bool:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    result = _PROGRAMS[rule].evaluate({"self": celpy.json_to_cel(value)})
    if isinstance(result, Exception):
        raise result
    return bool(result)


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Evaluate every x-kubernetes-validations rule where the object has a value, with cel-python."""
    errors = [
        f"{path or '<root>'}: {rule['message']}"
        for rule in schema.get("x-kubernetes-validations", [])
        if not _evaluate(rule["rule"], value)
    ]
    if isinstance(value, dict):
        for name, child in schema.get("properties", {}).items():
            if name in value:
                errors += cel_errors(child, value[name], f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{index}]")
    return errors


def list_map_keys(schema: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Paths of `x-kubernetes-list-type: map` lists (server-side apply merges them by key) -> their key."""
    found: dict[tuple[str, ...], str] = {}
    # one key is all our CRD uses; a multi-key list-map (upstream CRDs: ports by containerPort and protocol)
    # stays an atomic list here (docs/operator.md, what the double does not model)
    if schema.get("x-kubernetes-list-type") == "map" and len(schema["x-kubernetes-list-map-keys"]) == 1:
        (key,) = schema["x-kubernetes-list-map-keys"]
        found[prefix] = key
    for name, child in (schema.get("properties") or {}).items():
        found.update(list_map_keys(child, (*prefix, name)))
    if isinstance(schema.get("items"), dict):
        found.update(list_map_keys(schema["items"], prefix))
    return found
