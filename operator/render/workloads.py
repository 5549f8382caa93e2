"""The engine workloads of one InferenceService: what runs the engine pods, by the spec's shape.

- aggregated, one pod per model copy: one Deployment `NAME` (deployment.py);
- `spec.disaggregation`: one Deployment per role, `NAME-prefill` and `NAME-decode`;
- `engine.nodes > 1`: one LeaderWorkerSet `NAME` (leaderworkerset.x-k8s.io/v1, the API KServe and llm-d run
  multi-node models with): a group of `nodes` pods per model copy, the leader (worker index 0) runs the
  server and the first pipeline stages, each worker the next equal run of stages.

The multi-node pods carry the rendezvous torch.distributed's `env://` reads: MASTER_ADDR (the leader's
address, from LWS_LEADER_ADDRESS, which the LeaderWorkerSet webhook puts first in every container's env),
MASTER_PORT, SPECFLEET_NODES and SPECFLEET_NODE_RANK (the pod's worker index). The engine's ranks are
local processes today: it refuses SPECFLEET_NODES > 1 at start with a message (engine/__main__.py), so
the rendering is validated against the upstream schema but untested on a cluster (docs/operator.md).
"""

from __future__ import annotations

from typing import Any

from ..config import OperatorConfig
from ..inference_service import InferenceService
from ..resources import (
    ENGINE_CONTAINER,
    LABEL_ISVC,
    LABEL_WORKER_OF,
    RENDEZVOUS_PORT,
    common_labels,
)
from .common import child_metadata
from .deployment import (
    _int_or_percent,
    _pod_spec,
    engine_pod_annotations,
    engine_pod_labels,
    render_deployment,
)

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"


def render_engine_workloads(
    isvc: InferenceService, config: OperatorConfig | None = None
) -> list[dict[str, Any]]:
    """The engine workload(s) in apply order."""
    config = config or OperatorConfig()
    if isvc.spec.engine.nodes > 1:
        return [render_leader_worker_set(isvc, config)]
    return [render_deployment(isvc, config, role) for role in isvc.roles]


def rendezvous_env(nodes: int) -> list[dict[str, Any]]:
    """What a rank needs to find its group (torch.distributed's env:// names, plus the node count/rank)."""
    return [
        {"name": "MASTER_ADDR", "value": f"$({LWS_LEADER_ADDRESS_ENV})"},
        {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "SPECFLEET_NODES", "value": str(nodes)},
        {
            "name": "SPECFLEET_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LWS_WORKER_INDEX_LABEL}']"}},
        },
    ]


def worker_labels(isvc: InferenceService) -> dict[str, str]:
    """A worker pod is not an engine endpoint: without LABEL_ISVC nothing that selects engines (Services,
    PDB, tuner, ServiceMonitor, NetworkPolicy) selects it."""
    labels = {k: v for k, v in common_labels(isvc.name).items() if k != LABEL_ISVC}
    return {**isvc.spec.pod.labels, **labels, LABEL_WORKER_OF: isvc.name}


def _worker_pod(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The leader's pod without what makes it a server: its stages answer the leader, not clients."""
    pod = _pod_spec(isvc, config, extra_env=rendezvous_env(isvc.spec.engine.nodes))
    (container,) = [c for c in pod["containers"] if c["name"] == ENGINE_CONTAINER]
    for key in ("startupProbe", "livenessProbe", "readinessProbe", "ports"):
        container.pop(key, None)
    return pod


def _leader_pod(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    pod = _pod_spec(isvc, config, extra_env=rendezvous_env(isvc.spec.engine.nodes))
    (container,) = [c for c in pod["containers"] if c["name"] == ENGINE_CONTAINER]
    container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    return pod


def render_leader_worker_set(isvc: InferenceService, config: OperatorConfig | None = None) -> dict[str, Any]:
    config = config or OperatorConfig()
    spec = isvc.spec
    kind, surge, unavailable = spec.rollout.resolved(spec.resources.gpus)
    # the LeaderWorkerSet rolls groups only: Recreate is every group unavailable at once
    rolling = (
        {"maxSurge": 0, "maxUnavailable": "100%"}
        if kind == "Recreate"
        else {"maxSurge": _int_or_percent(surge), "maxUnavailable": _int_or_percent(unavailable)}
    )
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": child_metadata(isvc, isvc.name),
        "spec": {
            "replicas": isvc.desired_replicas,
            # workers are created with the leader, not after it is ready: the leader's rank 0 is ready only
            # once every stage has joined its rendezvous
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling},
            "leaderWorkerTemplate": {
                "size": spec.engine.nodes,
                # a lost stage stalls the whole pipeline: the group restarts together
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {
                        "labels": engine_pod_labels(isvc, None),
                        "annotations": engine_pod_annotations(isvc),
                    },
                    "spec": _leader_pod(isvc, config),
                },
                "workerTemplate": {
                    "metadata": {
                        "labels": worker_labels(isvc),
                        "annotations": {
                            **spec.pod.annotations,
                            "kubectl.kubernetes.io/default-container": ENGINE_CONTAINER,
                        },
                    },
                    "spec": _worker_pod(isvc, config),
                },
            },
        },
    }
