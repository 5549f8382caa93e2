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

OWNED_TYPES = ("Ready", "Progressing", "Degraded", "Monitored")  # the reconcile's; the tuner owns Tuned


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


@dataclass(frozen=True)
class Rollout:
    """What the Deployment controller reports about the Deployment the reconcile applied."""

    desired: int
    synced: bool  # the controller has observed the Deployment's latest generation
    replicas: int  # pods of every revision
    updated: int  # pods of the latest template
    available: int
    ready: int

    @classmethod
    def of(cls, desired: int, deployment: dict[str, Any] | None) -> Rollout | None:
        status = (deployment or {}).get("status") or {}
        if deployment is None or "observedGeneration" not in status:
            return None
        return cls(
            desired,
            status["observedGeneration"] >= deployment["metadata"].get("generation", 0),
            status.get("replicas", 0),
            status.get("updatedReplicas", 0),
            status.get("availableReplicas", 0),
            status.get("readyReplicas", 0),
        )

    @property
    def complete(self) -> bool:
        """Ready means this: every pod runs the latest template and is available, and no old pod is left."""
        return self.synced and self.updated == self.replicas == self.available == self.desired

    def describe(self) -> str:
        """What is rolling, in words."""
        if not self.synced:
            return "the Deployment controller has not observed the latest Deployment yet"
        old = self.replicas - self.updated
        if self.updated < self.desired or old > 0:
            return (
                f"rolling out a new pod template: {self.updated}/{self.desired} pods updated, "
                f"{self.available} available, {old} old pod(s) left"
            )
        if self.available < self.desired:
            return f"scaling to {self.desired} replicas: {self.available}/{self.desired} available"
        return f"{self.available}/{self.desired} replicas available, all on the latest pod template"


def deployment_conditions(isvc: InferenceService, deployment: dict[str, Any] | None) -> list[Cond]:
    desired = isvc.desired_replicas
    rollout = Rollout.of(desired, deployment)
    if rollout is None:
        return [
            Cond("Ready", "Unknown", "Pending", "waiting for the Deployment controller to report"),
            Cond("Progressing", "True", "Creating", f"rolling out {desired} replica(s)"),
            Cond("Degraded", "False", "AsExpected", "no problem reported"),
        ]
    found = {c["type"]: c for c in (deployment or {}).get("status", {}).get("conditions", [])}
    deadline = found.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
    failure = found.get("ReplicaFailure", {})
    counts = rollout.describe()

    if desired == 0:
        ready_cond = Cond("Ready", "False", "ScaledToZero", "spec.replicas is 0; scale up to serve requests")
    elif not rollout.synced:
        ready_cond = Cond("Ready", "Unknown", "Pending", counts)
    elif rollout.complete:
        ready_cond = Cond("Ready", "True", "AllReplicasReady", counts)
    elif rollout.updated < desired or rollout.replicas > rollout.updated:
        ready_cond = Cond("Ready", "False", "RollingOut", counts)
    else:
        ready_cond = Cond("Ready", "False", "ReplicasNotReady", counts)

    if deadline:
        progressing = Cond("Progressing", "False", "ProgressDeadlineExceeded", counts)
    elif rollout.complete or (desired == 0 and rollout.synced and rollout.replicas == 0):
        progressing = Cond("Progressing", "False", "RolloutComplete", counts)
    else:
        progressing = Cond("Progressing", "True", "RollingOut", counts)

    if deadline:
        message = found["Progressing"].get("message", "")
        degraded = Cond(
            "Degraded",
            "True",
            "ProgressDeadlineExceeded",
            f"{message}; check `kubectl describe pods -l {LABEL_ISVC}={isvc.name}`",
        )
    elif failure.get("status") == "True":
        degraded = Cond(
            "Degraded", "True", "ReplicaFailure", failure.get("message", "pods cannot be created")
        )
    else:
        degraded = Cond("Degraded", "False", "AsExpected", "no problem reported")
    return [ready_cond, progressing, degraded]


def invalid_spec_conditions(message: str) -> list[Cond]:
    return [
        Cond("Ready", "False", "InvalidSpec", message),
        Cond("Progressing", "False", "InvalidSpec", "nothing is rolled out until the spec is fixed"),
        Cond("Degraded", "True", "InvalidSpec", message),
    ]


def condition_entries(
    previous: list[dict[str, Any]], new: list[Cond], generation: int | None, now: str
) -> list[dict[str, Any]]:
    """The writer's own conditions as status entries; lastTransitionTime is kept unless the status flips.

    Only the writer's entries: each writer server-side applies its share of `status.conditions` (a map
    keyed by type) with its own field manager, so the API server keeps the other writers' entries.
    """
    before = {c.get("type"): c for c in previous}
    entries = []
    for cond in new:
        old = before.get(cond.type, {})
        changed = old.get("status") != cond.status
        entry: dict[str, Any] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message[:4096],
            "lastTransitionTime": now
            if changed or "lastTransitionTime" not in old
            else old["lastTransitionTime"],
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        entries.append(entry)
    return entries


def tuning_seed(isvc: InferenceService) -> dict[str, Any] | None:
    """The config in force while autotune is off, for the K/MaxSeqs columns; None while the tuner owns it."""
    spec = isvc.spec
    if spec.autotune.enabled:
        return None
    return {
        **{camel(name): value for name, value in spec.start_values().items()},
        "reason": "autotune is off: values from spec",
    }


def build_status(
    isvc: InferenceService,
    deployment: dict[str, Any] | None,
    previous: dict[str, Any],
    now: str,
    conditions: list[Cond] | None = None,
    observed: bool | None = None,
) -> dict[str, Any]:
    """The reconcile's whole share of status, server-side applied as its field manager (a field it owned
    and omits now is removed; the tuner's fields are not its to touch).

    `observedGeneration` (status and conditions) moves to the object's generation only once the status
    describes that generation: the Deployment controller has observed the Deployment rendered from it, or
    the outcome is known otherwise (`observed=True`: invalid spec, child refused). Until then the previous
    value stays, so GitOps tools see a status older than the spec.
    """
    rollout = Rollout.of(isvc.spec.replicas, deployment)
    known = observed if observed is not None else (rollout is not None and rollout.synced)
    stamped = isvc.metadata.generation if known else previous.get("observedGeneration")
    conds = conditions if conditions is not None else deployment_conditions(isvc, deployment)
    dstatus = (deployment or {}).get("status") or {}
    status: dict[str, Any] = {
        "conditions": condition_entries(previous.get("conditions") or [], conds, stamped, now),
        "replicas": dstatus.get("replicas", 0),
        "readyReplicas": dstatus.get("readyReplicas", 0),
        "selector": f"{LABEL_ISVC}={isvc.name}",
        "endpoint": endpoint(isvc.name, isvc.namespace),
    }
    if stamped is not None:
        status["observedGeneration"] = stamped
    seed = tuning_seed(isvc)
    if seed is not None:
        before = previous.get("tuning") or {}
        unchanged = seed == {k: before.get(k) for k in seed}
        status["tuning"] = {
            **seed,
            "lastDecisionTime": before.get("lastDecisionTime", now) if unchanged else now,
        }
    return status
