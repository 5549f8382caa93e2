"""The fleet router per InferenceService: its Deployment, its RBAC (watch the engines' EndpointSlices) and
the engines' headless Service it discovers them through. Pure functions of the spec.

With `spec.routing.enabled` the client-facing Service (network.py) selects the router pods; the router
forwards to the engines it finds in the EndpointSlices of `<name>-engines`.
"""

from __future__ import annotations

from typing import Any

from ..config import OperatorConfig
from ..inference_service import InferenceService
from ..resources import (
    ENGINE_PORT,
    ROUTER_PORT,
    common_labels,
    engines_service_name,
    router_labels,
    router_name,
    router_selector_labels,
    selector_labels,
)
from .common import owner_reference
from .deployment import CONTAINER_SECURITY_CONTEXT, RUN_AS_USER
from .slo import slo_service_labels

# The router holds no model: a few hundred MB covers aiohttp, the prefix index (65,536 hashes per engine,
# ~10 MB) and its buffers; one core forwards thousands of requests a second.
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}


def _metadata(isvc: InferenceService, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": isvc.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(isvc)],
    }


def router_args(isvc: InferenceService) -> list[str]:
    spec = isvc.spec
    routing = spec.routing
    return [
        "--service",
        engines_service_name(isvc.name),
        "--namespace",
        isvc.namespace,
        "--port",
        str(ROUTER_PORT),
        "--port-name",
        "http",
        "--policy",
        routing.policy,
        "--load-factor",
        f"{routing.load_factor_percent / 100:g}",
        "--session-header",
        routing.session_header,
        "--queue-timeout",
        str(routing.queue_timeout_seconds),
        "--block-size",
        str(spec.engine.block_size),
        "--model",
        spec.model.source,
    ]


def render_router_deployment(isvc: InferenceService, config: OperatorConfig | None = None) -> dict[str, Any]:
    config = config or OperatorConfig()
    routing = isvc.spec.routing
    http = {"path": "/ready", "port": "http"}
    container = {
        "name": "router",
        "image": routing.image or config.router_image,
        "imagePullPolicy": isvc.spec.engine.image_pull_policy,
        "command": ["python", "-m", "specfleet.router"],
        "args": router_args(isvc),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": ROUTER_RESOURCES,
        "securityContext": CONTAINER_SECURITY_CONTEXT,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(isvc, router_name(isvc.name), router_labels(isvc.name)),
        "spec": {
            "replicas": routing.replicas,
            "selector": {"matchLabels": router_selector_labels(isvc.name)},
            "template": {
                "metadata": {
                    "labels": router_labels(isvc.name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ROUTER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": router_name(isvc.name),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS_USER,
                        "runAsGroup": RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    # A router pod finishes its streams on SIGTERM; a minute covers typical generations.
                    "terminationGracePeriodSeconds": 60,
                },
            },
        },
    }


def render_engines_service(isvc: InferenceService) -> dict[str, Any]:
    """Headless: one DNS record and one EndpointSlice address per engine pod, no kube-proxy spreading."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        # the engines' Service carries the SLO threshold labels the ServiceMonitor copies onto their series
        "metadata": _metadata(
            isvc, engines_service_name(isvc.name), {**common_labels(isvc.name), **slo_service_labels(isvc)}
        ),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(isvc.name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_router_rbac(isvc: InferenceService) -> list[dict[str, Any]]:
    """ServiceAccount, Role (read EndpointSlices in this namespace) and RoleBinding for the router pods."""
    name, labels = router_name(isvc.name), router_labels(isvc.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(isvc, name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(isvc, name, labels),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(isvc, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}],
        },
    ]


def render_router_children(
    isvc: InferenceService, config: OperatorConfig | None = None
) -> list[dict[str, Any]]:
    """Everything routing adds, in apply order (RBAC before the pods that use it); [] when routing is off."""
    if not isvc.spec.routing.enabled:
        return []
    return [*render_router_rbac(isvc), render_engines_service(isvc), render_router_deployment(isvc, config)]
