"""What the API server checks in the fields the spec passes through to child objects, so that admission
refuses them instead of the API server refusing the child (a Degraded InferenceService): Kubernetes' name
and label grammars (apimachinery's validation), the values a toleration may take, and the keys of the
upstream objects the spec embeds as free-form dicts for pydantic (the CRD takes their schema from the
Kubernetes OpenAPI; tests/operator/test_op_admission_refusals.py checks these shapes against it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Written without backslashes, so that one string serves as a CEL literal and a Python or pydantic regex.
# A DNS-1123 subdomain: Secret, ServiceAccount, PriorityClass, RuntimeClass and claim names.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = rf"^{_LABEL}([.]{_LABEL})*$"
# The same, or empty (a field whose "" means "the cluster's default").
OPTIONAL_DNS1123_SUBDOMAIN = rf"^({_LABEL}([.]{_LABEL})*)?$"
# A label key (a qualified name: an optional DNS subdomain prefix and `/`, then at most 63 characters) and
# a label value (at most 63 characters): nodeSelector's keys and values.
LABEL_KEY_PATTERN = rf"^({_LABEL}([.]{_LABEL})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_VALUE_MAX = 63

# A toleration's operator and effect (core/v1 Toleration; "" is every effect).
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute", "")

# The keys of an embedded upstream object: a dict is an object with these keys, a 1-tuple a list of such
# objects, None a value whose own keys are not checked (a scalar, a list of strings, a label map).
Shape = dict[str, Any] | tuple[Any] | None
_REQUIREMENT = {"key": None, "operator": None, "values": None}
_LABEL_SELECTOR = {"matchLabels": None, "matchExpressions": (_REQUIREMENT,)}
_NODE_TERM = {"matchExpressions": (_REQUIREMENT,), "matchFields": (_REQUIREMENT,)}
_POD_TERM = {
    "labelSelector": _LABEL_SELECTOR,
    "namespaceSelector": _LABEL_SELECTOR,
    "namespaces": None,
    "topologyKey": None,
    "matchLabelKeys": None,
    "mismatchLabelKeys": None,
}
_POD_AFFINITY = {
    "requiredDuringSchedulingIgnoredDuringExecution": (_POD_TERM,),
    "preferredDuringSchedulingIgnoredDuringExecution": ({"weight": None, "podAffinityTerm": _POD_TERM},),
}
AFFINITY: dict[str, Any] = {  # io.k8s.api.core.v1.Affinity
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": (_NODE_TERM,)},
        "preferredDuringSchedulingIgnoredDuringExecution": ({"weight": None, "preference": _NODE_TERM},),
    },
    "podAffinity": _POD_AFFINITY,
    "podAntiAffinity": _POD_AFFINITY,
}
TOLERATION: dict[str, Any] = {  # io.k8s.api.core.v1.Toleration
    "key": None,
    "operator": None,
    "value": None,
    "effect": None,
    "tolerationSeconds": None,
}
TOPOLOGY_SPREAD_CONSTRAINT: dict[str, Any] = {  # io.k8s.api.core.v1.TopologySpreadConstraint
    "maxSkew": None,
    "topologyKey": None,
    "whenUnsatisfiable": None,
    "labelSelector": _LABEL_SELECTOR,
    "minDomains": None,
    "nodeAffinityPolicy": None,
    "nodeTaintsPolicy": None,
    "matchLabelKeys": None,
}


def unknown_fields(value: Any, shape: Shape, path: str) -> list[str]:
    """The paths under `value` that `shape` does not declare (a typo the API server refuses under
    kubectl's default Strict field validation), and objects given as something else."""
    if shape is None:
        return []
    if isinstance(shape, tuple):
        if not isinstance(value, list):
            return [f"{path} must be a list"]
        return [e for i, item in enumerate(value) for e in unknown_fields(item, shape[0], f"{path}[{i}]")]
    if not isinstance(value, Mapping):
        return [f"{path} must be an object"]
    errors = [f"{path}.{key} is not a field (known: {', '.join(shape)})" for key in value if key not in shape]
    return errors + [
        e for key in shape if key in value for e in unknown_fields(value[key], shape[key], f"{path}.{key}")
    ]


def toleration_errors(toleration: Mapping[str, Any], path: str) -> list[str]:
    """What the API server refuses in one toleration (core/v1 validation), each naming the field."""
    errors = []
    operator, effect = toleration.get("operator", "Equal"), toleration.get("effect", "")
    if operator not in TOLERATION_OPERATORS:
        errors.append(f"{path}.operator={operator!r} {TOLERATION_RULES['operator'][1]}")
    if effect not in TOLERATION_EFFECTS:
        errors.append(f"{path}.effect={effect!r} {TOLERATION_RULES['effect'][1]}")
    if operator == "Exists" and toleration.get("value"):
        errors.append(f"{path}.value={toleration['value']!r}: {TOLERATION_RULES['value'][1]}")
    if not toleration.get("key") and operator != "Exists":
        errors.append(f"{path}.key: {TOLERATION_RULES['key'][1]}")
    if "tolerationSeconds" in toleration and effect != "NoExecute":
        errors.append(f"{path}.tolerationSeconds: {TOLERATION_RULES['tolerationSeconds'][1]}")
    return errors


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


# The same rules as CEL over the tolerations list (`t` one toleration): field -> (rule, message).
TOLERATION_RULES = {
    "operator": (
        f"!has(t.operator) || t.operator in {_cel_list(TOLERATION_OPERATORS)}",
        f"must be one of {', '.join(TOLERATION_OPERATORS)}",
    ),
    "effect": (
        f"!has(t.effect) || t.effect in {_cel_list(TOLERATION_EFFECTS)}",
        "must be one of NoSchedule, PreferNoSchedule, NoExecute or empty (every effect)",
    ),
    "value": (
        "!has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == ''",
        "a toleration with operator Exists takes no value",
    ),
    "key": (
        "(has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists')",
        "an empty key needs operator Exists (it tolerates every taint)",
    ),
    "tolerationSeconds": (
        "!has(t.tolerationSeconds) || (has(t.effect) && t.effect == 'NoExecute')",
        "tolerationSeconds applies to effect NoExecute only",
    ),
}


def toleration_cel() -> list[dict[str, str]]:
    """The CRD's rules on a tolerations list, one per field, each message naming it."""
    return [
        {"rule": f"self.all(t, {rule})", "message": f"tolerations[].{field}: {message}"}
        for field, (rule, message) in TOLERATION_RULES.items()
    ]
