"""The Service clients reach the engines through, its PodDisruptionBudget and its ServiceMonitor."""

from __future__ import annotations

from typing import Any

from ..config import OperatorConfig
from ..inference_service import InferenceService
from ..resources import (
    ADMIN_PORT,
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    KV_TRANSFER_PORT,
    LABEL_INSTANCE,
    LABEL_ROLE,
    LABEL_WORKER_OF,
    router_labels,
    router_selector_labels,
    selector_labels,
)
from .common import child_metadata
from .slo import slo_relabelings, slo_service_labels


def render_service(isvc: InferenceService) -> dict[str, Any]:
    """The Service clients use: the router pods with `routing.enabled`, else the engine pods themselves.
    With the router it carries the router's labels, so the engines' ServiceMonitor does not scrape it, and
    the SLO threshold labels (`slo.py`) go on the engines' headless Service (router.py) instead."""
    metadata = child_metadata(isvc, isvc.name)
    selector = selector_labels(isvc.name)
    if isvc.spec.routing.enabled:
        metadata["labels"], selector = router_labels(isvc.name), router_selector_labels(isvc.name)
    else:
        metadata["labels"].update(slo_service_labels(isvc))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def wants_pdb(isvc: InferenceService) -> bool:
    """A PDB only makes sense with more than one engine pod: with one it would block every node drain. With
    spec.disaggregation it spans both roles (one engine of either role evicted at a time)."""
    return isvc.total_engines > 1


def render_pdb(isvc: InferenceService) -> dict[str, Any] | None:
    """At most one engine pod voluntarily evicted at a time; None when `wants_pdb` is false."""
    if not wants_pdb(isvc):
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(isvc, isvc.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(isvc.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_servicemonitor(isvc: InferenceService, interval: str = "15s") -> dict[str, Any]:
    """Prometheus Operator scrape config; the reconcile applies it only when that CRD is installed."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(isvc, isvc.name),
        "spec": {
            "selector": {"matchLabels": selector_labels(isvc.name)},
            # job = the InferenceService's name whichever Service holds the engines (the tuner's PromQL
            # selects job="<name>"): the client Service without the router, `<name>-engines` with it.
            "jobLabel": LABEL_INSTANCE,
            "namespaceSelector": {"matchNames": [isvc.namespace]},
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": interval,
                    "relabelings": [*slo_relabelings(), ROLE_RELABELING],
                }
            ],
        },
    }


# The engine pod's role (spec.disaggregation) onto its series as `specfleet_role`, so that the tuner's PromQL
# reads the decode engines only; absent on aggregated engines (an empty value drops the label).
ROLE_RELABELING: dict[str, object] = {
    "sourceLabels": ["__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in LABEL_ROLE)],
    "targetLabel": "specfleet_role",
    "action": "replace",
}


def render_network_policy(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """Ingress to the engine pods: the API port from anywhere the Service's clients are, the admin port only
    from the operator's pods (its namespace and pod labels). Applied when the chart's networkPolicy.enabled."""
    operator_pods = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}},
        "podSelector": {"matchLabels": dict(config.operator_pod_labels)},
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(isvc, isvc.name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(isvc.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": ENGINE_PORT, "protocol": "TCP"}]},
                {"from": [operator_pods], "ports": [{"port": ADMIN_PORT, "protocol": "TCP"}]},
                # prefill engines' held KV: pulled by this service's engines, released by its router
                *(
                    [
                        {
                            "from": [
                                {"podSelector": {"matchLabels": selector_labels(isvc.name)}},
                                {"podSelector": {"matchLabels": router_selector_labels(isvc.name)}},
                            ],
                            "ports": [{"port": KV_TRANSFER_PORT, "protocol": "TCP"}],
                        }
                    ]
                    if isvc.spec.disaggregation
                    else []
                ),
                # routing.kvEvents: the engines' KV events, subscribed to (and replayed) by this service's router
                *(
                    [
                        {
                            "from": [{"podSelector": {"matchLabels": router_selector_labels(isvc.name)}}],
                            "ports": [
                                {"port": KV_EVENTS_PORT, "protocol": "TCP"},
                                {"port": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"},
                            ],
                        }
                    ]
                    if isvc.spec.routing.routes_on_kv_events
                    else []
                ),
                # a multi-node leader: its group's workers reach the rendezvous and the collectives' ports
                *(
                    [{"from": [{"podSelector": {"matchLabels": {LABEL_WORKER_OF: isvc.name}}}]}]
                    if isvc.spec.engine.nodes > 1
                    else []
                ),
            ],
        },
    }
