"""Status from what exists: conditions Ready/Progressing/Degraded, replica counts and the endpoint.

Pure functions of the InferenceService and its Deployment as the API server reports it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from specfleet.engine.knobs import camel

from .inference_service import InferenceService
from .resources import LABEL_ISVC, endpoint

OWNED_TYPES = ("Ready", "Progressing", "Degraded")


def timestamp() -> str:
    """Now as the Kubernetes API writes times (RFC 3339, UTC, whole seconds): lastTransitionTime and the
    status times the operator and the tuner write."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Cond:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def deployment_conditions(isvc: InferenceService, deployment: dict[str, Any] | None) -> list[Cond]:
    desired = isvc.spec.replicas
    if deployment is None or "observedGeneration" not in (deployment.get("status") or {}):
        return [
            Cond("Ready", "Unknown", "Pending", "waiting for the Deployment controller to report"),
            Cond("Progressing", "True", "Creating", f"rolling out {desired} replica(s)"),
            Cond("Degraded", "False", "AsExpected", "no problem reported"),
        ]
    status = deployment["status"]
    ready = status.get("readyReplicas", 0)
    updated = status.get("updatedReplicas", 0)
    current = status.get("replicas", 0)
    synced = status["observedGeneration"] >= deployment["metadata"].get("generation", 0)
    found = {c["type"]: c for c in status.get("conditions", [])}
    deadline = found.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
    failure = found.get("ReplicaFailure", {})
    rolled_out = synced and updated == desired and current == desired and ready == desired
    counts = f"{ready}/{desired} replicas ready, {updated}/{desired} updated"

    if desired == 0:
        ready_cond = Cond("Ready", "False", "ScaledToZero", "spec.replicas is 0; scale up to serve requests")
    elif ready >= desired:
        ready_cond = Cond("Ready", "True", "AllReplicasReady", counts)
    else:
        ready_cond = Cond("Ready", "False", "ReplicasNotReady", counts)

    if deadline:
        progressing = Cond("Progressing", "False", "ProgressDeadlineExceeded", counts)
    elif rolled_out:
        progressing = Cond("Progressing", "False", "RolloutComplete", counts)
    else:
        progressing = Cond("Progressing", "True", "RollingOut", counts)

    if deadline:
        message = found["Progressing"].get("message", "")
        degraded = Cond("Degraded", "True", "ProgressDeadlineExceeded",
                        f"{message}; check `kubectl describe pods -l {LABEL_ISVC}={isvc.name}`")
    elif failure.get("status") == "True":
        degraded = Cond("Degraded", "True", "ReplicaFailure", failure.get("message", "pods cannot be created"))
    else:
        degraded = Cond("Degraded", "False", "AsExpected", "no problem reported")
    return [ready_cond, progressing, degraded]


def invalid_spec_conditions(message: str) -> list[Cond]:
    return [
        Cond("Ready", "False", "InvalidSpec", message),
        Cond("Progressing", "False", "InvalidSpec", "nothing is rolled out until the spec is fixed"),
        Cond("Degraded", "True", "InvalidSpec", message),
    ]


def merge_conditions(
    previous: list[dict[str, Any]], new: list[Cond], generation: int, now: str
) -> list[dict[str, Any]]:
    """Ours replaced (lastTransitionTime kept unless the status flips); others' conditions kept as they are."""
    before = {c.get("type"): c for c in previous}
    merged = []
    for cond in new:
        old = before.get(cond.type, {})
        changed = old.get("status") != cond.status
        merged.append({
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": now if changed or "lastTransitionTime" not in old else old["lastTransitionTime"],
            "observedGeneration": generation,
        })
    owned = {c.type for c in new}
    return merged + [c for c in previous if c.get("type") not in owned]


def tuning_seed(isvc: InferenceService, current: dict[str, Any] | None) -> dict[str, Any] | None:
    """The config in force, for the K/MaxSeqs columns: the spec's values unless the tuner owns them."""
    if isvc.spec.autotune.enabled and current:
        return None  # the tuner's decision stands; it is the only writer while autotune is on
    spec = isvc.spec
    reason = "autotune is off: values from spec" if not spec.autotune.enabled else "initial values from spec"
    return {**{camel(name): value for name, value in spec.start_values().items()}, "reason": reason}


def build_status(
    isvc: InferenceService, deployment: dict[str, Any] | None, previous: dict[str, Any], now: str,
    conditions: list[Cond] | None = None,
) -> dict[str, Any]:
    """The status patch the reconcile writes (merge patch: keys not listed here are left alone)."""
    generation = isvc.metadata.generation
    conds = conditions if conditions is not None else deployment_conditions(isvc, deployment)
    dstatus = (deployment or {}).get("status") or {}
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": merge_conditions(previous.get("conditions") or [], conds, generation, now),
        "replicas": dstatus.get("replicas", 0),
        "readyReplicas": dstatus.get("readyReplicas", 0),
        "selector": f"{LABEL_ISVC}={isvc.name}",
        "endpoint": endpoint(isvc.name, isvc.namespace),
    }
    seed = tuning_seed(isvc, previous.get("tuning"))
    if seed is not None:
        status["tuning"] = {**seed, "lastDecisionTime": (previous.get("tuning") or {}).get("lastDecisionTime", now)}
        if seed != {k: (previous.get("tuning") or {}).get(k) for k in seed}:
            status["tuning"]["lastDecisionTime"] = now
    return status
