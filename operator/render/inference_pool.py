"""routing.mode endpoint-picker: the Gateway API Inference Extension's objects. Pure functions of the spec.

- an `InferencePool` (inference.networking.k8s.io/v1) named as the InferenceService: the engine pods (the
  decode engines with spec.disaggregation) on the engine port, its endpoint picker the router;
- `NAME-epp`, a Service over the router pods' ext_proc port (h2c gRPC), which the pool's endpointPickerRef
  names;
- with routing.endpointPicker.gateway, an `HTTPRoute` (gateway.networking.k8s.io/v1) from that Gateway to the
  pool, every path.

The router pods run with `--ext-proc-port` (router.py); the gateway's controller configures its proxy to call
them per request (router/endpoint_picker.py).
"""

from __future__ import annotations

from typing import Any

from ..inference_service import InferenceService
from ..resources import (
    ENGINE_PORT,
    EPP_PORT,
    epp_service_name,
    role_selector_labels,
    router_labels,
    router_selector_labels,
)
from .common import child_metadata, owner_reference

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
EPP_PORT_NAME = "grpc-ext-proc"


def engine_pool_labels(isvc: InferenceService) -> dict[str, str]:
    """The pods the pool selects: the engines that take requests (decode ones with roles)."""
    return role_selector_labels(isvc.name, "decode" if isvc.spec.disaggregation else None)


def render_inference_pool(isvc: InferenceService) -> dict[str, Any]:
    picker = isvc.spec.routing.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": child_metadata(isvc, isvc.name),
        "spec": {
            "selector": {"matchLabels": engine_pool_labels(isvc)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_service_name(isvc.name),
                "port": {"number": EPP_PORT},
                "failureMode": picker.failure_mode,
            },
        },
    }


def render_epp_service(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": epp_service_name(isvc.name),
            "namespace": isvc.namespace,
            "labels": router_labels(isvc.name),
            "ownerReferences": [owner_reference(isvc)],
        },
        "spec": {
            "selector": router_selector_labels(isvc.name),
            "ports": [
                {
                    "name": EPP_PORT_NAME,
                    "port": EPP_PORT,
                    "targetPort": EPP_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",  # gRPC without TLS, as gateways call an EPP
                }
            ],
        },
    }


def render_http_route(isvc: InferenceService) -> dict[str, Any] | None:
    gateway = isvc.spec.routing.endpoint_picker.gateway
    if gateway is None:
        return None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    if gateway.section_name:
        parent["sectionName"] = gateway.section_name
    return {
        "apiVersion": HTTP_ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": child_metadata(isvc, isvc.name),
        "spec": {
            "parentRefs": [parent],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": isvc.name}
                    ],
                }
            ],
        },
    }


def render_endpoint_picker_children(isvc: InferenceService) -> list[dict[str, Any]]:
    """The pool, its picker's Service and the optional route, in apply order; [] in proxy mode."""
    if isvc.spec.routing.mode != "endpoint-picker" or not isvc.spec.routing.enabled:
        return []
    route = render_http_route(isvc)
    return [render_epp_service(isvc), render_inference_pool(isvc), *([route] if route else [])]
