"""Names the operator and its tests share: the API group, labels, ports and child object names."""

from __future__ import annotations

GROUP = "serving.specfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
LIST_KIND = "InferenceServiceList"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("isvc",)

# Server-side apply field managers: one per writer, so that each owns its own fields (status conditions
# included: the CRD's conditions list is a map keyed by type) and neither can remove the other's.
FIELD_MANAGER = "specfleet-operator"  # the reconcile: children, and status except what the tuner owns
TUNER_FIELD_MANAGER = "specfleet-tuner"  # the tuner: status.tuning and the Tuned condition
# the tuner's replica knob: status.autoscaling, applied on its own (scale from zero does not wait for an interval)
AUTOSCALER_FIELD_MANAGER = "specfleet-autoscaler"
ENGINE_PORT = 8000  # the OpenAI API and /metrics: what the Service exposes
# The admin API (/admin/config) on its own port, which no Service exposes: the tuner reaches each pod on
# its IP (and a NetworkPolicy can admit only the operator there), so Service clients cannot try tokens.
ADMIN_PORT = 8001
ENGINE_CONTAINER = "engine"
ADMIN_TOKEN_KEY = "token"
ADMIN_TOKEN_ENV = "SPECFLEET_ADMIN_TOKEN"
# The engine reads its admin token from this file (the Secret mounted read-only), not from the environment.
ADMIN_TOKEN_FILE_ENV = "SPECFLEET_ADMIN_TOKEN_FILE"
ADMIN_TOKEN_DIR = "/var/run/secrets/specfleet/admin"
# The key the endpoint picker signs the prefill engine it names with, and the decode engines check it with
# (engine/kv_transfer/prefill_signature.py): its own Secret (NAME-pd-key), mounted read-only into the router
# and decode pods only, never beside the admin token (the router must not hold the engines' admin token).
PREFILL_KEY_KEY = "key"
PREFILL_KEY_DIR = "/var/run/secrets/specfleet/pd-key"
PREFILL_KEY_VOLUME = "pd-key"
# The engine's caches (native kernels, converted models, HF, Triton) on the pod's writable emptyDir.
CACHE_DIR = "/cache"
# The `NAME-tuned` ConfigMap (the tuner's config in force), mounted here read-only: the engine starts on
# the values in its file (`--live-config-file`), so a new pod serves its first request tuned.
TUNED_CONFIG_DIR = "/etc/specfleet/tuned"
TUNED_CONFIG_VOLUME = "tuned-config"

LABEL_ISVC = f"{GROUP}/inferenceservice"
# With spec.disaggregation each engine pod carries its role (prefill or decode); the role's Deployment and
# headless Service select it together with LABEL_ISVC, and the ServiceMonitor copies it onto the series.
LABEL_ROLE = f"{GROUP}/role"
ROLES = ("prefill", "decode")
# The prefill engines serve their held KV blocks here (the engine's --kv-transfer-port); decode engines pull
# from it and the router sends its hold releases to it. Not in any Service: peers dial the pod IP the
# prefill engine names in its kv_transfer_params.
KV_TRANSFER_PORT = 8002
# The engines' KV events (routing.kvEvents, engine/kv_events.py): the ZeroMQ PUB socket on vLLM's default
# port (and llm-d's socketPort) and the replay socket beside it, the same on every engine pod, so that the
# router derives each discovered engine's sockets from its pod IP. Not in any Service.
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558
# The model's tokenizer files in the router pods (an emptyDir the router's init step fills; `--tokenizer`).
TOKENIZER_DIR = "/var/lib/specfleet/tokenizer"
# Multi-node engines (a LeaderWorkerSet): worker pods carry this label instead of LABEL_ISVC, so that what
# selects engines (the Services, the PDB, the tuner's pod list, the ServiceMonitor) selects leaders only.
LABEL_WORKER_OF = f"{GROUP}/worker-of"
# torch.distributed's rendezvous port on the leader pod (torch's own default, as torchrun uses).
RENDEZVOUS_PORT = 29500
# Router pods carry this label and not LABEL_ISVC, so nothing that selects engines selects them.
LABEL_ROUTER = f"{GROUP}/router"
ROUTER_PORT = ENGINE_PORT  # clients keep the port they had before the router stood in front
# routing.mode endpoint-picker: the router's ext_proc gRPC port (the Gateway API Inference Extension's
# default EPP port, which InferencePool's endpointPickerRef names).
EPP_PORT = 9002
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "specfleet-operator"

# The suffixes of the children's names (`NAME-engines`...). A Service name is a DNS-1035 label and the name
# is a label value on every child: each must fit in 63 characters, so the InferenceService's own name is
# refused at admission beyond MAX_NAME_LENGTH (the CRD's root rule and ObjectMeta.name).
ADMIN_SUFFIX = "-admin"
TUNED_SUFFIX = "-tuned"
ROUTER_SUFFIX = "-router"
ENGINES_SUFFIX = "-engines"
EPP_SUFFIX = "-epp"
PD_KEY_SUFFIX = "-pd-key"
CHILD_NAME_SUFFIXES = (
    ADMIN_SUFFIX,
    PD_KEY_SUFFIX,
    TUNED_SUFFIX,
    ROUTER_SUFFIX,
    ENGINES_SUFFIX,
    EPP_SUFFIX,
    *(f"-{r}" for r in ROLES),
)
DNS1035_LABEL_MAX = 63
MAX_NAME_LENGTH = DNS1035_LABEL_MAX - max(len(s) for s in CHILD_NAME_SUFFIXES)
LONGEST_CHILD_SUFFIX = max(CHILD_NAME_SUFFIXES, key=len)


def admin_secret_name(isvc_name: str) -> str:
    return f"{isvc_name}{ADMIN_SUFFIX}"


def prefill_key_secret_name(isvc_name: str) -> str:
    """spec.disaggregation behind routing.mode endpoint-picker: the endpoint picker's signing key."""
    return f"{isvc_name}{PD_KEY_SUFFIX}"


def epp_service_name(isvc_name: str) -> str:
    """routing.mode endpoint-picker: the router pods' ext_proc Service, the InferencePool's endpointPickerRef."""
    return f"{isvc_name}{EPP_SUFFIX}"


def tuned_config_name(isvc_name: str) -> str:
    return f"{isvc_name}{TUNED_SUFFIX}"


def selector_labels(isvc_name: str) -> dict[str, str]:
    """Labels the Deployment, Service, PDB and ServiceMonitor select pods by; never change them."""
    return {LABEL_ISVC: isvc_name}


def role_selector_labels(isvc_name: str, role: str | None) -> dict[str, str]:
    """The engine pods of one role (all engine pods when `role` is None: aggregated)."""
    return {**selector_labels(isvc_name), **({LABEL_ROLE: role} if role else {})}


def engine_workload_name(isvc_name: str, role: str | None) -> str:
    """The engine Deployment (or LeaderWorkerSet): NAME, or NAME-prefill / NAME-decode with roles."""
    return f"{isvc_name}-{role}" if role else isvc_name


def common_labels(isvc_name: str) -> dict[str, str]:
    return {
        LABEL_NAME: "specfleet-engine",
        LABEL_INSTANCE: isvc_name,
        LABEL_COMPONENT: "inference-server",
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(isvc_name),
    }


def router_selector_labels(isvc_name: str) -> dict[str, str]:
    return {LABEL_ROUTER: isvc_name}


def router_labels(isvc_name: str) -> dict[str, str]:
    return {
        LABEL_NAME: "specfleet-router",
        LABEL_INSTANCE: isvc_name,
        LABEL_COMPONENT: "router",
        LABEL_MANAGED_BY: MANAGED_BY,
        **router_selector_labels(isvc_name),
    }


def router_name(isvc_name: str) -> str:
    return f"{isvc_name}{ROUTER_SUFFIX}"


def engines_service_name(isvc_name: str, role: str | None = None) -> str:
    """The engines' headless Service: its EndpointSlices are what the router watches. With roles, one per
    role, named as the role's Deployment (NAME-prefill, NAME-decode)."""
    return engine_workload_name(isvc_name, role) if role else f"{isvc_name}{ENGINES_SUFFIX}"


def endpoint(isvc_name: str, namespace: str) -> str:
    return f"http://{isvc_name}.{namespace}.svc:{ENGINE_PORT}/v1"
