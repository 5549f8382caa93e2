"""The engine Deployment: one pod template per InferenceService, a pure function of its spec.

Tuned values (k, batch limits) never enter the template: the tuner pushes them to running pods through
the admin API, and a new pod starts on them from the `NAME-tuned` ConfigMap it mounts (tuned.py), which
the template names but does not contain, so tuning causes no rollout. A spec change does, as users expect.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from specfleet.engine.args import flag_args
from specfleet.engine.config import FCFS
from specfleet.engine.kv_transfer.prefill_signature import KEY_FILE_FLAG

from ..config import OperatorConfig
from ..inference_service import InferenceService
from ..resources import (
    ADMIN_PORT,
    ADMIN_TOKEN_DIR,
    ADMIN_TOKEN_FILE_ENV,
    ADMIN_TOKEN_KEY,
    CACHE_DIR,
    ENGINE_CONTAINER,
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    KV_TRANSFER_PORT,
    LABEL_ROLE,
    PREFILL_KEY_DIR,
    PREFILL_KEY_KEY,
    PREFILL_KEY_VOLUME,
    TUNED_CONFIG_DIR,
    TUNED_CONFIG_VOLUME,
    admin_secret_name,
    common_labels,
    engine_workload_name,
    prefill_key_secret_name,
    role_selector_labels,
    tuned_config_name,
)
from ..spec import InferenceServiceSpec
from .adapters import lora_args, with_adapters
from .common import child_metadata
from .model_source import DownloadSettings, ResolvedSource, parse_quantity, resolve_source

# The images' USER (tests/operator/test_op_images.py); >= 10000 stays clear of the node's own users.
RUN_AS_USER = 10000
PROBE_PERIOD_SECONDS = 10
# Termination, in order (docs/operator.md, Rollouts): the pod leaves the Service's endpoints while the preStop
# hook sleeps (kube-proxy and ingress controllers need a few seconds to see it: 5 s covers the usual 1-2 s
# EndpointSlice propagation with margin); then SIGTERM: /ready fails at once but new requests are still
# served for SHUTDOWN_DELAY_SECONDS (stragglers routed before the removal), then refused with 503 while
# in-flight requests finish within drainTimeoutSeconds; the kubelet's SIGKILL comes after all of them plus
# GRACE_MARGIN_SECONDS (process exit, log flush).
PRESTOP_SLEEP_SECONDS = 5
SHUTDOWN_DELAY_SECONDS = 2
GRACE_MARGIN_SECONDS = 15

CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


# The pod's own IP from the downward API: a prefill engine binds its KV server to it and names it in the
# kv_transfer_params it returns, so decode pods and the router dial it directly.
POD_IP_ENV = "SPECFLEET_POD_IP"


def role_args(role: str | None) -> list[str]:
    """A role's flags (`$(SPECFLEET_POD_IP)` is expanded by the kubelet from the container's env)."""
    if role is None:
        return []
    args = ["--kv-role", role]
    if role == "prefill":
        args += ["--kv-transfer-host", f"$({POD_IP_ENV})", "--kv-transfer-port", str(KV_TRANSFER_PORT)]
    return args


def engine_args(
    spec: InferenceServiceSpec, model_uri: str, draft_uri: str | None, role: str | None = None
) -> list[str]:
    """The engine command line, from the spec alone (the pod contract in docs/operator.md); `role` is the
    engine's role with spec.disaggregation (the local fleet adds its own loopback flags instead)."""
    method = spec.speculative.method
    args = [
        "--model",
        model_uri,
        "--host",
        "0.0.0.0",  # the kubelet's probes and the Service reach the pod on its IP
        "--port",
        str(ENGINE_PORT),
        "--admin-port",
        str(ADMIN_PORT),
        "--block-size",
        str(spec.engine.block_size),
        "--max-model-len",
        str(spec.model.max_model_len),
        "--dtype",
        spec.model.dtype,
        "--speculative-method",
        method,
        *flag_args(spec.start_values()),  # each searched knob's start value (engine/knobs.py)
        *flag_args(spec.ceiling_values()),  # and its ceiling, covering the tuner's bounds
        "--kv-cache-memory-fraction",
        str(spec.engine.kv_cache_memory_fraction),
        "--drain-timeout",
        str(spec.engine.drain_timeout_seconds),
        "--shutdown-delay",
        str(SHUTDOWN_DELAY_SECONDS),
    ]
    if spec.model.quantization != "none":
        args += ["--quantization", spec.model.quantization]
    if spec.engine.tensor_parallel_size > 1:  # the engine spawns its ranks in the pod, one GPU each
        args += ["--tensor-parallel-size", str(spec.engine.tensor_parallel_size)]
    if spec.engine.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(spec.engine.pipeline_parallel_size)]
    if method != "none" and spec.speculative.disable_by_batch_size:
        args += ["--speculative-disable-by-batch-size", str(spec.speculative.disable_by_batch_size)]
    if draft_uri is not None:
        args += ["--draft-model", draft_uri]
        if spec.speculative.draft_model is not None and spec.speculative.draft_model.quantization != "none":
            args += ["--draft-quantization", spec.speculative.draft_model.quantization]
    if not spec.engine.prefix_caching:
        args.append("--no-prefix-caching")
    if spec.engine.scheduling_policy != FCFS:  # the default is left out: existing pods keep their command
        args += ["--scheduling-policy", spec.engine.scheduling_policy]
    if spec.observability.otlp_traces_endpoint:
        args += ["--otlp-traces-endpoint", spec.observability.otlp_traces_endpoint]
    args += lora_args(spec)
    return args + role_args(role) + list(spec.engine.extra_args)


def live_config_file(spec: InferenceServiceSpec) -> str:
    """The key of the `NAME-tuned` ConfigMap this spec's engines start on: named by a hash of their command
    line, which fixes the ceilings an engine checks the values against. A pod of another template (a spec
    change rolling out) finds no file under its name and starts on its flags, never on values tuned under
    other ceilings; the tuner writes the new name at its next tick (tuner/handlers.py)."""
    draft = spec.speculative.draft_model
    command = engine_args(spec, spec.model.source, draft.source if draft else None)
    return f"live-config-{hashlib.sha256(json.dumps(command).encode()).hexdigest()[:12]}.json"


def tuned(role: str | None) -> bool:
    """Whether the tuner tunes this role's engines: all but prefill's (tuner/handlers.py)."""
    return role != "prefill"


def _with_live_config(args: list[str], spec: InferenceServiceSpec, role: str | None) -> list[str]:
    """`--live-config-file` for a tuned role, before the user's `engine.extraArgs` (last, so they win)."""
    if not tuned(role):
        return args
    at = len(args) - len(spec.engine.extra_args)
    return [*args[:at], "--live-config-file", f"{TUNED_CONFIG_DIR}/{live_config_file(spec)}", *args[at:]]


def signed_prefill(isvc: InferenceService, role: str | None) -> bool:
    """A decode engine behind the endpoint picker: it honours x-prefiller-host-port only when the picker
    signed it, with the key of the `NAME-pd-key` Secret it mounts (InferenceService.signs_prefill)."""
    return role == "decode" and isvc.signs_prefill


def prefill_key_volume(isvc: InferenceService) -> dict[str, Any]:
    """The signing key as a read-only file (mode 0440, group fsGroup), as the admin token is."""
    return {
        "name": PREFILL_KEY_VOLUME,
        "secret": {
            "secretName": prefill_key_secret_name(isvc.name),
            "defaultMode": 0o440,
            "items": [{"key": PREFILL_KEY_KEY, "path": PREFILL_KEY_KEY}],
        },
    }


PREFILL_KEY_MOUNT = {"name": PREFILL_KEY_VOLUME, "mountPath": PREFILL_KEY_DIR, "readOnly": True}
PREFILL_KEY_ARGS = [KEY_FILE_FLAG, f"{PREFILL_KEY_DIR}/{PREFILL_KEY_KEY}"]


def _with_prefill_key(args: list[str], isvc: InferenceService, role: str | None) -> list[str]:
    """`--remote-prefill-key-file` on a signed decode engine, before the user's `engine.extraArgs`."""
    if not signed_prefill(isvc, role):
        return args
    at = len(args) - len(isvc.spec.engine.extra_args)
    return [*args[:at], *PREFILL_KEY_ARGS, *args[at:]]


KV_EVENTS_FLAG = "--kv-events-config"


def kv_events_config() -> dict[str, Any]:
    """vLLM's KVEventsConfig the engines publish with under routing.kvEvents: the PUB and replay sockets
    bound on every address of the pod, on the same ports in every pod (the router derives them from the pod
    IPs it discovers); the buffer, high-water mark and topic are vLLM's defaults."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
    }


def _with_kv_events(args: list[str], spec: InferenceServiceSpec) -> list[str]:
    """`--kv-events-config` when the router routes on the engines' KV events, before `engine.extraArgs`.
    Not in engine_args: the local fleet (`specfleet up`) runs every engine on one host and gives each
    sockets of its own (fleet/supervisor.py)."""
    if not spec.routing.routes_on_kv_events:
        return args
    at = len(args) - len(spec.engine.extra_args)
    config = json.dumps(kv_events_config(), separators=(",", ":"))
    return [*args[:at], KV_EVENTS_FLAG, config, *args[at:]]


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    """preStop sleep + the engine's shutdown delay + its drain timeout + a margin (see the constants)."""
    return (
        PRESTOP_SLEEP_SECONDS
        + SHUTDOWN_DELAY_SECONDS
        + spec.engine.drain_timeout_seconds
        + GRACE_MARGIN_SECONDS
    )


def _resources(spec: InferenceServiceSpec, ephemeral: str | None) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, Any] = {"cpu": r.cpu, "memory": r.memory}
    limits: dict[str, Any] = {"memory": r.memory}
    if ephemeral:
        requests["ephemeral-storage"] = ephemeral
    if r.gpus > 0:
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    return {"requests": requests, "limits": limits}


def _int_or_percent(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


def render_strategy(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Deployment's strategy from `spec.rollout` (GPU pods default to no surge: see RolloutSpec)."""
    kind, surge, unavailable = spec.rollout.resolved(spec.resources.gpus)
    if kind == "Recreate":
        return {"type": "Recreate"}
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": _int_or_percent(surge), "maxUnavailable": _int_or_percent(unavailable)},
    }


def _probes(spec: InferenceServiceSpec) -> dict[str, Any]:
    def http(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": failures,
        }

    startup_failures = max(1, math.ceil(spec.engine.startup_timeout_seconds / PROBE_PERIOD_SECONDS))
    return {
        # /health answers while the model loads; the startup probe gives loading its own budget.
        "startupProbe": http("/health", PROBE_PERIOD_SECONDS, startup_failures),
        "livenessProbe": http("/health", PROBE_PERIOD_SECONDS, 3),
        "readinessProbe": http("/ready", 5, 2),
    }


def _volumes(spec: InferenceServiceSpec, isvc_name: str, role: str | None) -> list[dict[str, Any]]:
    # optional: before the tuner's first push there is no ConfigMap, and the engine starts on its flags
    tuned_config = {
        "name": TUNED_CONFIG_VOLUME,
        "configMap": {"name": tuned_config_name(isvc_name), "optional": True},
    }
    return [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        # The token as a read-only file (mode 0440, group fsGroup) instead of an environment variable.
        {
            "name": "admin-token",
            "secret": {
                "secretName": admin_secret_name(isvc_name),
                "defaultMode": 0o440,
                "items": [{"key": ADMIN_TOKEN_KEY, "path": ADMIN_TOKEN_KEY}],
            },
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
        *([tuned_config] if tuned(role) else []),
    ]


def _signed_volumes(isvc: InferenceService, role: str | None) -> list[dict[str, Any]]:
    return [prefill_key_volume(isvc)] if signed_prefill(isvc, role) else []


def _env(isvc: InferenceService, role: str | None, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # the pod's own entries first: a `$(VAR)` reference resolves only to variables defined before it
    pod_ip = [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}] if role else []
    return [*pod_ip, *extra, *(dict(e) for e in isvc.spec.pod.env), *_own_env(isvc)]


def _own_env(isvc: InferenceService) -> list[dict[str, Any]]:
    return [
        {"name": ADMIN_TOKEN_FILE_ENV, "value": f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/hf"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "SPECFLEET_CACHE", "value": f"{CACHE_DIR}/specfleet"},  # the native kernels build here
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "SPECFLEET_SERVICE_NAME", "value": isvc.name},
    ]


def _pod_spec(
    isvc: InferenceService,
    config: OperatorConfig,
    role: str | None = None,
    extra_env: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The engine pod; `role` with spec.disaggregation, `extra_env` for a multi-node group's rendezvous."""
    spec = isvc.spec
    image = config.image_for(spec.resources.gpus, spec.engine.image)
    model, draft = _sources(spec, config, image)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": spec.pod.automount_service_account_token,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(isvc, image, model, draft, role, extra_env or [])],
        "volumes": [
            *_volumes(spec, isvc.name, role),
            *_signed_volumes(isvc, role),
            *model.volumes,
            *draft.volumes,
            *(dict(v) for v in spec.pod.volumes),
        ],
    }
    init = [*model.init_containers, *draft.init_containers]
    if init:
        pod["initContainers"] = init
    pod.update(pod_passthrough(spec))
    return pod


def _sources(
    spec: InferenceServiceSpec, config: OperatorConfig, image: str
) -> tuple[ResolvedSource, ResolvedSource]:
    """The model's source resolved to what the pod mounts and downloads, and the draft model's (an empty
    one without a draft model)."""
    download = DownloadSettings(
        image=config.model_downloader_image or image,
        image_pull_policy=spec.engine.image_pull_policy,
        security_context=CONTAINER_SECURITY_CONTEXT,
        hf_token_secret=spec.model.hf_token_secret,
        cache_claim=spec.model.cache.claim_name,
        size_limit=spec.model.cache.size_limit,
    )
    model = with_adapters(resolve_source(spec.model.source, "model", download), spec, download)
    draft_model = spec.speculative.draft_model
    return model, resolve_source(draft_model.source, "draft", download) if draft_model else ResolvedSource("")


def _engine_container(
    isvc: InferenceService,
    image: str,
    model: ResolvedSource,
    draft: ResolvedSource,
    role: str | None,
    extra_env: list[dict[str, Any]],
) -> dict[str, Any]:
    """The engine's container: its command line, ports, env, resources, probes and mounts."""
    spec = isvc.spec
    draft_uri = draft.engine_uri if spec.speculative.draft_model else None
    return {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python", "-m", "specfleet.engine"],
        "args": _with_kv_events(
            _with_prefill_key(
                _with_live_config(engine_args(spec, model.engine_uri, draft_uri, role), spec, role),
                isvc,
                role,
            ),
            spec,
        ),
        "ports": _engine_ports(role, spec.routing.routes_on_kv_events),
        "env": _env(isvc, role, extra_env),
        **({"envFrom": [dict(e) for e in spec.pod.env_from]} if spec.pod.env_from else {}),
        "resources": _resources(spec, _sum_quantities([model.ephemeral_storage, draft.ephemeral_storage])),
        **_probes(spec),
        # The pod leaves the endpoints while this runs; SIGTERM comes after it (see PRESTOP_SLEEP_SECONDS).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *(
                [{"name": TUNED_CONFIG_VOLUME, "mountPath": TUNED_CONFIG_DIR, "readOnly": True}]
                if tuned(role)
                else []
            ),
            *([PREFILL_KEY_MOUNT] if signed_prefill(isvc, role) else []),
            *model.mounts,
            *draft.mounts,
            *(dict(m) for m in spec.pod.volume_mounts),
        ],
    }


def _engine_ports(role: str | None, kv_events: bool) -> list[dict[str, Any]]:
    """HTTP, admin, on a prefill pod the KV transfer port, and the KV events' sockets when they publish."""
    return [
        {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
        # not in the Service: the tuner reaches it on the pod IP (docs/operator.md, admin port)
        {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
        *(
            [{"name": "kv", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"}]
            if role == "prefill"
            else []
        ),
        # not in any Service either: the router subscribes to each engine pod on its IP
        *(
            [
                {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                {"name": "kv-replay", "containerPort": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"},
            ]
            if kv_events
            else []
        ),
    ]


def pod_passthrough(spec: InferenceServiceSpec) -> dict[str, Any]:
    """spec.scheduling's and spec.pod's pod-level fields as the pod spec spells them, the unset ones left
    out: the engine pods take them all, the router pods some of them (router.py, ROUTER_POD_FIELDS)."""
    sched = spec.scheduling
    fields = {
        "nodeSelector": dict(sched.node_selector),
        "tolerations": [dict(t) for t in sched.tolerations],
        "affinity": dict(sched.affinity),
        "topologySpreadConstraints": [dict(t) for t in sched.topology_spread_constraints],
        "priorityClassName": sched.priority_class_name,
        "runtimeClassName": sched.runtime_class_name,
        "serviceAccountName": spec.pod.service_account_name,
        "imagePullSecrets": [dict(s) for s in spec.pod.image_pull_secrets],
    }
    return {key: value for key, value in fields.items() if value}


def _sum_quantities(values: list[str | None]) -> str | None:
    """Sizes of the hf:// download volumes, added (both are `sizeLimit` strings of the same spec)."""
    present = [v for v in values if v]
    if len(present) <= 1:
        return present[0] if present else None
    return f"{sum(parse_quantity(v) for v in present)}"


def engine_pod_labels(isvc: InferenceService, role: str | None) -> dict[str, str]:
    return {**isvc.spec.pod.labels, **common_labels(isvc.name), **({LABEL_ROLE: role} if role else {})}


def engine_pod_annotations(isvc: InferenceService) -> dict[str, str]:
    return {
        **isvc.spec.pod.annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        "kubectl.kubernetes.io/default-container": ENGINE_CONTAINER,
    }


def render_deployment(
    isvc: InferenceService, config: OperatorConfig | None = None, role: str | None = None
) -> dict[str, Any]:
    """The engine Deployment: NAME, or with spec.disaggregation one per role (NAME-prefill, NAME-decode)."""
    config = config or OperatorConfig()
    metadata = child_metadata(isvc, engine_workload_name(isvc.name, role))
    if role:
        metadata["labels"][LABEL_ROLE] = role
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": isvc.role_replicas(role),
            # immutable: a role's Deployment selects its role only, so the two never fight over pods
            "selector": {"matchLabels": role_selector_labels(isvc.name, role)},
            "strategy": render_strategy(isvc.spec),
            "progressDeadlineSeconds": isvc.spec.engine.startup_timeout_seconds + 300,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": engine_pod_labels(isvc, role),
                    "annotations": engine_pod_annotations(isvc),
                },
                "spec": _pod_spec(isvc, config, role),
            },
        },
    }
