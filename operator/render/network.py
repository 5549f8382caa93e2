"""The Service clients reach the engines through, its PodDisruptionBudget and its ServiceMonitor."""

from __future__ import annotations

from typing import Any

from ..config import OperatorConfig
from ..inference_service import InferenceService
from ..resources import (
    ADMIN_PORT,
    ENGINE_PORT,
    LABEL_INSTANCE,
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
    """A PDB only makes sense with more than one replica: with one it would block every node drain."""
    return isvc.desired_replicas > 1


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
                {"port": "http", "path": "/metrics", "interval": interval, "relabelings": slo_relabelings()}
            ],
        },
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
            ],
        },
    }
