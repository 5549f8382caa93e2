"""Status from what exists: conditions Ready/Progressing/Degraded, replica counts and the endpoint.

Pure functions of the InferenceService and its workloads as the API server reports them: the engines' (one
Deployment, one per role with spec.disaggregation, or a LeaderWorkerSet) and, with routing on, the router
Deployment. Ready only when every one of them is: clients reach the engines through the router, so a router
that cannot start (ImagePullBackOff) is a service that does not answer.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from specfleet.engine.knobs import camel

from .inference_service import InferenceService
from .resources import LABEL_ISVC, endpoint


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
class Workload:
    """One workload (Deployment or LeaderWorkerSet) as the API server reports it, and the count of pods
    (LeaderWorkerSet: groups) it should run. `engines`: its pods are engines, counted in status.replicas
    (the scale subresource's); the router's are not. `pods`: the label selector of its pods, for messages."""

    name: str
    desired: int
    obj: dict[str, Any] | None
    engines: bool = True
    pods: str = ""


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
        ready = status.get("readyReplicas", 0)
        # a LeaderWorkerSet reports no availableReplicas: a group counts once it is ready
        return cls(
            desired,
            status["observedGeneration"] >= deployment["metadata"].get("generation", 0),
            status.get("replicas", 0),
            status.get("updatedReplicas", 0),
            status.get("availableReplicas", ready),
            ready,
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
        if old == 0 and self.replicas > self.desired:  # the same template, fewer pods: the extra ones stop
            return (
                f"scaling down to {self.desired} replicas: {self.replicas - self.desired} pod(s) left to stop"
            )
        if self.updated < self.desired or old > 0:
            return (
                f"rolling out a new pod template: {self.updated}/{self.desired} pods updated, "
                f"{self.available} available, {old} old pod(s) left"
            )
        if self.available < self.desired:
            return f"scaling to {self.desired} replicas: {self.available}/{self.desired} available"
        return f"{self.available}/{self.desired} replicas available, all on the latest pod template"


def deployment_conditions(isvc: InferenceService, workloads: list[Workload]) -> list[Cond]:
    """Ready/Progressing/Degraded over every engine workload: each is judged alone, then Ready is True only
    when all are, Progressing when any rolls, Degraded when any is (messages name the workload)."""
    if len(workloads) == 1:
        return _workload_conditions(isvc, workloads[0])
    judged = [(w.name, _workload_conditions(isvc, w)) for w in workloads]

    def combined(index: int, status_order: tuple[str, ...]) -> Cond:
        conds = [(name, c[index]) for name, c in judged]
        message = "; ".join(f"{name}: {c.message}" for name, c in conds)
        for wanted in status_order:  # the first workload in the most telling state gives the reason
            hit = next((c for _, c in conds if c.status == wanted), None)
            if hit is not None:
                return Cond(hit.type, hit.status, hit.reason, message)
        raise AssertionError("unreachable: every condition has a status")

    ready = combined(0, ("False", "Unknown", "True"))
    progress = [c[1] for _, c in judged]
    deadline = next((c for c in progress if c.reason == "ProgressDeadlineExceeded"), None)
    progressing = (
        Cond(deadline.type, deadline.status, deadline.reason, combined(1, ("False",)).message)
        if deadline
        else combined(1, ("True", "False"))
    )
    return [ready, progressing, combined(2, ("True", "False"))]


def _zero_engines(isvc: InferenceService) -> str:
    """Why no engine runs, as Argo CD and `kubectl get` show it: the spec, or with autoscaling the tuner
    (spec.replicas is then its start value only)."""
    if isvc.spec.autoscaling.enabled:
        return "the tuner scaled to autoscaling.minReplicas 0; a request the router queues scales it up"
    return "spec.replicas is 0; scale up to serve requests"


def _workload_conditions(isvc: InferenceService, workload: Workload) -> list[Cond]:
    desired, deployment = workload.desired, workload.obj
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
        ready_cond = Cond("Ready", "False", "ScaledToZero", _zero_engines(isvc))
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
            f"{message}; check `kubectl describe pods -l {workload.pods or f'{LABEL_ISVC}={isvc.name}'}`",
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
    workloads: list[Workload],
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
    rollouts = [Rollout.of(w.desired, w.obj) for w in workloads]
    known = observed if observed is not None else all(r is not None and r.synced for r in rollouts)
    stamped = isvc.metadata.generation if known else previous.get("observedGeneration")
    conds = conditions if conditions is not None else deployment_conditions(isvc, workloads)
    statuses = [(w.obj or {}).get("status") or {} for w in workloads if w.engines]
    status: dict[str, Any] = {
        "conditions": condition_entries(previous.get("conditions") or [], conds, stamped, now),
        "replicas": sum(s.get("replicas", 0) for s in statuses),
        "readyReplicas": sum(s.get("readyReplicas", 0) for s in statuses),
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
