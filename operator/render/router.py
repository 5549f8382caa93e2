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
    EPP_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    LABEL_ROLE,
    ROUTER_PORT,
    TOKENIZER_DIR,
    common_labels,
    engines_service_name,
    role_selector_labels,
    router_labels,
    router_name,
    router_selector_labels,
)
from ..spec import RouterPodSpec
from .common import owner_reference
from .deployment import (
    CONTAINER_SECURITY_CONTEXT,
    PREFILL_KEY_ARGS,
    PREFILL_KEY_MOUNT,
    PRESTOP_SLEEP_SECONDS,
    RUN_AS_USER,
    SHUTDOWN_DELAY_SECONDS,
    pod_passthrough,
    prefill_key_volume,
    termination_grace_seconds,
)
from .inference_pool import EPP_PORT_NAME, render_endpoint_picker_children
from .slo import slo_service_labels
from .tokenizer import TOKENIZER_MOUNT, engine_chat_args, tokenizer_init_container, tokenizer_volumes

# The router holds no model: a few hundred MB covers aiohttp, the prefix index (65,536 hashes per engine,
# ~10 MB) and its buffers; one core forwards thousands of requests a second.
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}
# What the router pods take from the engines' pod passthrough (pull secrets, node selector, tolerations,
# affinity, priority class), unless routing.pod sets it. Not the ServiceAccount (the router's own holds its
# EndpointSlice RBAC; the pull secrets go on the pod, so it needs none of the engines'), the runtime class
# (a GPU runtime) or the topology spread constraints (they select engine pods).
ROUTER_PASSTHROUGH = tuple(RouterPodSpec().model_dump(by_alias=True))
# Preferred, not required: two router pods may share a node when no other fits (a one-node cluster).
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


def _metadata(isvc: InferenceService, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": isvc.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(isvc)],
    }


def kv_events_args(isvc: InferenceService) -> list[str]:
    """routing.kvEvents with the prefix policy: subscribe to every discovered engine's KV events on the
    ports the engines publish on (deployment.py kv_events_config), read with the model's tokenizer the init
    step copies (tokenizer.py)."""
    if not isvc.spec.routing.routes_on_kv_events:
        return []
    return [
        "--tokenizer",
        TOKENIZER_DIR,
        *engine_chat_args(isvc),
        "--kv-events-port",
        str(KV_EVENTS_PORT),
        "--kv-events-replay-port",
        str(KV_EVENTS_REPLAY_PORT),
    ]


def router_args(isvc: InferenceService) -> list[str]:
    spec = isvc.spec
    routing = spec.routing
    # with roles: the decode engines' Service is the one requests stream from, the prefill engines' the
    # one prompts go to first (router/disaggregation.py)
    roles = (
        [
            "--service",
            engines_service_name(isvc.name, "decode"),
            "--prefill-service",
            engines_service_name(isvc.name, "prefill"),
        ]
        if spec.disaggregation
        else ["--service", engines_service_name(isvc.name)]
    )
    return [
        *roles,
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
        *kv_events_args(isvc),
        # the engine's termination sequence and timings (deployment.py): an in-flight stream gets as long
        # through a router restart as through an engine's
        "--shutdown-delay",
        str(SHUTDOWN_DELAY_SECONDS),
        "--drain-timeout",
        str(spec.engine.drain_timeout_seconds),
        *(
            ["--otlp-traces-endpoint", spec.observability.otlp_traces_endpoint]
            if spec.observability.otlp_traces_endpoint
            else []
        ),
        *(["--adapter-affinity"] if spec.adapters else []),
        *(["--ext-proc-port", str(EPP_PORT)] if routing.mode == "endpoint-picker" else []),
        # the picker signs the prefill engine it names; the decode engines mount the same key
        *(PREFILL_KEY_ARGS if isvc.signs_prefill else []),
    ]


def router_placement(isvc: InferenceService) -> dict[str, Any]:
    """The router pod's pull secrets and placement: the engines' (ROUTER_PASSTHROUGH), each replaced by
    routing.pod's value where that is set, plus a preferred anti-affinity that spreads the router pods
    over nodes (a node drain then takes one of them, not all)."""
    inherited = {k: v for k, v in pod_passthrough(isvc.spec).items() if k in ROUTER_PASSTHROUGH}
    placement = {k: v for k, v in {**inherited, **isvc.spec.routing.pod.overrides()}.items() if v}
    affinity = dict(placement.get("affinity") or {})
    anti = dict(affinity.get("podAntiAffinity") or {})
    spread = {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": router_selector_labels(isvc.name)},
            "topologyKey": HOSTNAME_TOPOLOGY,
        },
    }
    preferred = "preferredDuringSchedulingIgnoredDuringExecution"
    anti[preferred] = [*anti.get(preferred, []), spread]
    return {**placement, "affinity": {**affinity, "podAntiAffinity": anti}}


def render_router_deployment(isvc: InferenceService, config: OperatorConfig | None = None) -> dict[str, Any]:
    config = config or OperatorConfig()
    routing = isvc.spec.routing
    http = {"path": "/ready", "port": "http"}
    image = routing.image or config.router_image
    kv_events = routing.routes_on_kv_events
    mounts = [*([TOKENIZER_MOUNT] if kv_events else []), *([PREFILL_KEY_MOUNT] if isvc.signs_prefill else [])]
    volumes = [
        *(tokenizer_volumes(isvc) if kv_events else []),
        *([prefill_key_volume(isvc)] if isvc.signs_prefill else []),
    ]
    container = {
        "name": "router",
        "image": image,
        "imagePullPolicy": isvc.spec.engine.image_pull_policy,
        "command": ["python", "-m", "specfleet.router"],
        "args": router_args(isvc),
        "ports": [
            {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
            *(
                [{"name": EPP_PORT_NAME, "containerPort": EPP_PORT, "protocol": "TCP"}]
                if routing.mode == "endpoint-picker"
                else []
            ),
        ],
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": ROUTER_RESOURCES,
        # The pod leaves the Service's endpoints while this runs; SIGTERM comes after it (the engine's
        # PRESTOP_SLEEP_SECONDS, for the same EndpointSlice propagation).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        **({"volumeMounts": mounts} if mounts else {}),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(isvc, router_name(isvc.name), router_labels(isvc.name)),
        "spec": {
            "replicas": routing.replicas,
            "selector": {"matchLabels": router_selector_labels(isvc.name)},
            # a router pod is small and starts in seconds: surge one, never below the ready count
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
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
                        # the key's file is group-readable (0440) by the pod's fsGroup, as on the engines
                        **({"fsGroup": RUN_AS_USER} if isvc.signs_prefill else {}),
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    **(
                        {"initContainers": [tokenizer_init_container(isvc, config, image)]}
                        if kv_events
                        else {}
                    ),
                    "containers": [container],
                    **({"volumes": volumes} if volumes else {}),
                    # preStop + shutdown delay + drain timeout + margin, as the engine's (router_args)
                    "terminationGracePeriodSeconds": termination_grace_seconds(isvc.spec),
                    **router_placement(isvc),
                },
            },
        },
    }


def render_engines_service(isvc: InferenceService, role: str | None = None) -> dict[str, Any]:
    """Headless: one DNS record and one EndpointSlice address per engine pod, no kube-proxy spreading. With
    spec.disaggregation one per role (NAME-prefill, NAME-decode), so the router tells the roles apart by the
    Service an address comes from."""
    labels = {**common_labels(isvc.name), **slo_service_labels(isvc), **({LABEL_ROLE: role} if role else {})}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        # the engines' Service carries the SLO threshold labels the ServiceMonitor copies onto their series
        "metadata": _metadata(isvc, engines_service_name(isvc.name, role), labels),
        "spec": {
            "clusterIP": "None",
            "selector": role_selector_labels(isvc.name, role),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def engines_services(isvc: InferenceService) -> list[dict[str, Any]]:
    """The engines' headless Service(s): `<name>-engines`, or one per role."""
    return [render_engines_service(isvc, role) for role in isvc.roles]


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


def render_router_pdb(isvc: InferenceService) -> dict[str, Any]:
    """At most one router pod voluntarily evicted at a time (a node drain, a cluster upgrade): with two or
    more the others keep serving. maxUnavailable, not minAvailable, so that one router pod never blocks a
    drain; a pod that is not ready may always be evicted (it serves nothing)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(isvc, router_name(isvc.name), router_labels(isvc.name)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": router_selector_labels(isvc.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_router_children(
    isvc: InferenceService, config: OperatorConfig | None = None
) -> list[dict[str, Any]]:
    """Everything routing adds, in apply order (RBAC before the pods that use it); [] when routing is off.
    In endpoint-picker mode also the InferencePool, its picker's Service and the HTTPRoute (inference_pool.py)."""
    if not isvc.spec.routing.enabled:
        return []
    return [
        *render_router_rbac(isvc),
        *engines_services(isvc),
        render_router_deployment(isvc, config),
        render_router_pdb(isvc),
        *render_endpoint_picker_children(isvc),
    ]
