"""The InferenceService spec as pydantic models: the one source of truth for the CRD's spec schema.

`crds/inferenceservice.yaml` is generated from these classes (`python -m specfleet.operator.generate`), so a
field, default, enum, bound or CEL rule is written once, here. Cross-field rules are written twice on
purpose, side by side: as a CEL expression the API server enforces (`x-kubernetes-validations`) and as the
equivalent Python check pydantic runs for `specfleet up` (no API server there); the tests evaluate both on
the same table of invalid inputs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

from annotated_types import Ge, Le
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from specfleet.engine.knobs import REPLICAS, SEARCHED, Knob, camel
from specfleet.engine.spec_decode.methods import SPECULATIVE_METHODS, methods_with_draft_model
from specfleet.router.policies import DEFAULT_POLICY, POLICIES
from specfleet.router.weights import DEFAULT_WEIGHT, MAX_WEIGHT

from .engine_flags import RESERVED_ARG_PATTERN, RESERVED_ARGS_MESSAGE, reserved_args
from .kube_grammar import (
    AFFINITY,
    DNS1123_SUBDOMAIN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_MAX,
    LABEL_VALUE_PATTERN,
    OPTIONAL_DNS1123_SUBDOMAIN,
    TOLERATION,
    TOPOLOGY_SPREAD_CONSTRAINT,
    Shape,
    toleration_cel,
    toleration_errors,
    unknown_fields,
)
from .resources import TUNED_CONFIG_DIR, TUNED_CONFIG_VOLUME

# A field whose CRD schema is the Kubernetes OpenAPI definition named here (see `upstream`).
K8S_SCHEMA_KEY = "x-specfleet-kubernetes-schema"

SOURCE_PATTERN = r"^(bundled://[a-z0-9][a-z0-9.-]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.+|hf://[^/@\s]+/[^/@\s]+(@[^\s]+)?)$"
# Kubernetes' quantity grammar (resource.ParseQuantity: a decimal number, then a binary-SI, decimal-SI or
# integer-exponent suffix), without the sign: requests and sizes are never negative. `1.2.3`, `1Gii` and
# `-16Gi` are refused at admission instead of by the API server when the Deployment is applied.
QUANTITY_PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
# The same with a non-zero digit: a size or request that must be positive (memory "0" or shmSize "0" would
# give the engine nothing to run in).
POSITIVE_QUANTITY_PATTERN = (
    r"^\+?([0-9]*[1-9][0-9]*(\.[0-9]*)?|[0-9]*\.[0-9]*[1-9][0-9]*)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
# A Deployment's maxSurge / maxUnavailable: a count or a percentage, without leading zeros ("00" is no
# number the API server reads); maxUnavailable's percentage is at most 100%.
INT_OR_PERCENT_PATTERN = r"^(0|[1-9][0-9]*)%?$"
INT_OR_PERCENT_TO_100_PATTERN = r"^(0|[1-9][0-9]*|([0-9]|[1-9][0-9]|100)%)$"


def _quantity_to_str(value: Any) -> Any:
    """An int-or-string field takes an integer or a string, as the API server does: a float is refused."""
    if isinstance(value, float):
        raise ValueError(
            f"{value!r} is a float: write an integer, or the quantity as a string ({str(value)!r})"
        )
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _int_or_string(pattern: str, minimum: int, **limits: Any) -> Any:
    """An int-or-string field's limits: `pattern` binds the string form, `minimum` the integer form."""
    return Field(
        pattern=pattern,
        **limits,
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": pattern, "minimum": minimum},
    )


# A Kubernetes resource quantity: YAML may write `cpu: 4` or `cpu: "500m"`.
Quantity = Annotated[str, BeforeValidator(_quantity_to_str), _int_or_string(QUANTITY_PATTERN, 0)]
PositiveQuantity = Annotated[
    str, BeforeValidator(_quantity_to_str), _int_or_string(POSITIVE_QUANTITY_PATTERN, 1)
]
IntOrPercent = Annotated[
    str, BeforeValidator(_quantity_to_str), _int_or_string(INT_OR_PERCENT_PATTERN, 0, max_length=8)
]
IntOrPercentTo100 = Annotated[
    str, BeforeValidator(_quantity_to_str), _int_or_string(INT_OR_PERCENT_TO_100_PATTERN, 0, max_length=8)
]


def cel(rule: str, message: str) -> dict[str, Any]:
    return {"rule": rule, "message": message}


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def _default_obj(factory: type[_Spec]) -> Any:
    """An object field the API server defaults to `{}` so that its own fields' defaults apply."""
    return Field(default_factory=factory, json_schema_extra={"default": {}})


# An hf:// source becomes a path: with model.cache.claimName the engine mounts `ORG/NAME/REVISION` of the
# claim as a subPath, which may not climb out of it (the API server refuses a `..` segment).
HF_PARENT_SEGMENT = "^hf://(.*[/@])?[.][.]([/@].*)?$"
HF_PARENT_MESSAGE = (
    "source: an hf://ORG/NAME@REVISION source may not have a '..' segment: it becomes a path in "
    "model.cache.claimName (the engine's subPath), which may not leave the claim"
)


class ModelSource(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!self.source.matches('{HF_PARENT_SEGMENT}')", HF_PARENT_MESSAGE)
            ]
        }
    )
    source: str = Field(
        pattern=SOURCE_PATTERN,
        max_length=512,
        description="Model URI: bundled://NAME, pvc://CLAIM/PATH, file:///ABS/PATH or hf://ORG/NAME[@REVISION].",
    )

    @model_validator(mode="after")
    def _no_parent_segment(self) -> ModelSource:
        if re.fullmatch(HF_PARENT_SEGMENT, self.source):
            raise ValueError(f"{self.source!r}: {HF_PARENT_MESSAGE}")
        return self


class DraftModelSpec(ModelSource):
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="int8: the draft's weights as int8 on the engine's native CPU kernels (CPU pods). With "
        "source set to the target's own, a cheap draft that agrees with it on most tokens.",
    )


class ModelCacheSpec(_Spec):
    size_limit: PositiveQuantity = Field(
        "40Gi",
        description="hf:// sources without claimName: the size of the pod's download volume, requested as "
        "ephemeral-storage so the scheduler places the pod where it fits (an 8B model in bf16 is ~16 GB).",
    )
    claim_name: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A PersistentVolumeClaim (ReadWriteMany for more than one pod) that hf:// downloads go to "
        "and are read from: each revision is downloaded once and shared by every pod and restart.",
    )


class ModelSpec(ModelSource):
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weight and activation dtype; auto is float32 on CPU and bfloat16 on GPU."
    )
    max_model_len: int = Field(4096, ge=16, le=1048576, description="Longest prompt + output, in tokens.")
    quantization: Literal["none", "int8", "gguf", "awq", "gptq"] = Field(
        "none",
        description="Weights run quantized (--quantization): int8 (the float weights, quantized at load), gguf "
        "(a GGUF source's Q4_0/Q4_1/Q4_K/Q8_0 tensors as stored), awq or gptq (4-bit checkpoints, also picked "
        "up from their own config). CPU pods run them on the native kernels; awq and gptq also on GPU. none: "
        "the float weights, exactly as transformers computes them.",
    )
    hf_token_secret: str | None = Field(
        None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="Secret (key HF_TOKEN) the hf:// download step reads, for gated models.",
    )
    cache: ModelCacheSpec = _default_obj(ModelCacheSpec)


GPUS_PER_SPLIT = (
    "resources.gpus must be 0 (CPU ranks) or the GPUs of one pod: engine.tensorParallelSize x "
    "engine.pipelineParallelSize / engine.nodes (one GPU per rank)"
)
QUANTIZED_SPLIT = (
    "model.quantization gguf, awq and gptq pack weights in blocks with per-block scales that are "
    "not sliced by attention head: with them engine.tensorParallelSize must be 1 "
    "(pipelineParallelSize splits them into stages; int8 splits either way)"
)
# Multi-node (a LeaderWorkerSet): pipeline stages spread over the pods of a group, an equal run on each.
NODES_SPLIT = (
    "engine.nodes > 1 spreads pipeline stages over pods: it needs pipelineParallelSize > 1 and a "
    "multiple of nodes"
)
# Prefill/decode roles: the KV connector moves one process's cache, and the router runs both halves.
DISAGGREGATION_SPLIT = (
    "spec.disaggregation needs engine.tensorParallelSize, pipelineParallelSize and nodes 1 "
    "(the KV connector moves one process's cache)"
)
DISAGGREGATION_ROUTING = (
    "spec.disaggregation needs routing.enabled: the router sends each request's prompt to a "
    "prefill engine and its stream to a decode engine"
)
# Scale to zero: with no engine, only a request the router holds wakes the service (the tuner scales 0 -> 1
# on the router's queue gauge); with routing off, or a queue timeout of 0, the router (or the Service)
# answers 503 at once, the tuner never sees demand and the service stays at zero.
SCALE_TO_ZERO = (
    "autoscaling.minReplicas 0 needs routing.enabled and routing.queueTimeoutSeconds > 0: at zero engines "
    "only a request the router holds wakes the service; without a queue it is refused at once and the "
    "service stays at zero"
)
DISAGGREGATION_REPLICAS = (
    "with spec.disaggregation the engine counts are disaggregation.prefill.replicas and "
    "disaggregation.decode.replicas: leave spec.replicas at 1 (kubectl scale does not apply)"
)


def _no_operator_flags(args: list[str]) -> list[str]:
    if reserved := reserved_args(args):
        raise ValueError(f"{reserved}: {RESERVED_ARGS_MESSAGE}")
    return args


class EngineSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.nodes == 1 || (self.pipelineParallelSize > 1 && self.pipelineParallelSize % self.nodes == 0)",
                    NODES_SPLIT,
                ),
            ]
        }
    )
    image: str | None = Field(
        None, max_length=512, description="Engine image; empty means the operator's default engine image."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, description="KV cache block size in tokens.")
    kv_cache_memory_fraction: float = Field(0.9, ge=0.05, le=0.99)
    prefix_caching: bool = True
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=8,
        description="Ranks one model copy is split over by tensor "
        "parallelism (one GPU each; processes sharing the CPU when gpus is 0).",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        le=8,
        description="Pipeline stages one model copy is split into "
        "(one GPU each; processes sharing the CPU when gpus is 0).",
    )
    nodes: int = Field(
        1,
        ge=1,
        le=8,
        description="Pods one model copy spans: >1 spreads the pipeline stages over "
        "that many pods (a LeaderWorkerSet: the leader runs stage 0 and the server, each worker "
        "an equal run of the next stages). Needs the LeaderWorkerSet controller in the cluster.",
    )
    drain_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="How long SIGTERM waits for in-flight requests before exiting."
    )
    startup_timeout_seconds: int = Field(
        900, ge=30, le=7200, description="How long the model may take to load before the pod is restarted."
    )
    extra_args: Annotated[
        list[Annotated[str, Field(max_length=1024)]], AfterValidator(_no_operator_flags)
    ] = Field(
        default_factory=list,
        max_length=64,
        description="Appended to the engine command line as given; not the flags the operator sets itself.",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"self.all(a, !a.matches('{RESERVED_ARG_PATTERN}'))", RESERVED_ARGS_MESSAGE)
            ]
        },
    )


class BatchingSpec(_Spec):
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences scheduled in one step.")
    max_num_batched_tokens: int = Field(2048, ge=16, le=1048576, description="Token budget of one step.")


def _draft_model_rules(methods: tuple[str, ...]) -> list[Any]:
    """draftModel set exactly with a method that needs one (spec_decode/methods.py), as CEL rules; their
    Python twin is SpeculativeSpec._draft_model_matches_method."""
    if not methods:
        return [cel("!has(self.draftModel)", "draftModel is not used by any speculative method")]
    names = " or ".join(methods)
    return [
        cel(
            " && ".join(f"self.method != '{m}'" for m in methods) + " || has(self.draftModel)",
            f"method: {names} needs draftModel.source (the small model that proposes tokens)",
        ),
        cel(
            " || ".join(f"self.method == '{m}'" for m in methods) + " || !has(self.draftModel)",
            f"draftModel is only used with method: {names}; set method: {methods[0]} or remove draftModel",
        ),
    ]


class SpeculativeSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": _draft_model_rules(methods_with_draft_model())}
    )
    method: Literal[SPECULATIVE_METHODS] = "none"  # type: ignore[valid-type]
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="k: tokens proposed per step (0 = off).")
    disable_by_batch_size: int = Field(
        0,
        ge=0,
        le=4096,
        description="A step whose batch is larger than this proposes nothing (0 = never). With autotune on, "
        "the tuner sets it to the batch at which it would turn speculation off itself (past the "
        "step cost's knee), so a load that rises between two intervals loses no time to drafts.",
    )
    draft_model: DraftModelSpec | None = None

    @model_validator(mode="after")
    def _draft_model_matches_method(self) -> SpeculativeSpec:
        needs = methods_with_draft_model()
        if self.method in needs and self.draft_model is None:
            raise ValueError(f"speculative.method={self.method!r} needs speculative.draftModel.source")
        if self.method not in needs and self.draft_model is not None:
            names = " or ".join(map(repr, needs)) or "no method"
            raise ValueError(
                f"speculative.draftModel is only used with method {names}, not {self.method!r}; "
                f"set method: {needs[0] if needs else '...'} or remove draftModel"
            )
        return self


class ResourcesSpec(_Spec):
    gpus: int = Field(1, ge=0, le=16, description="GPUs per replica; 0 runs the engine on CPU.")
    gpu_resource_name: str = Field("nvidia.com/gpu", pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$", max_length=253)
    cpu: PositiveQuantity = "4"
    memory: PositiveQuantity = "16Gi"
    shm_size: PositiveQuantity = Field("1Gi", description="Size of the in-memory /dev/shm volume.")


class DisaggregationRole(_Spec):
    replicas: int = Field(
        1,
        ge=1,
        le=1000,
        description="Engines of this role (decode: with autoscaling on, the tuner's count replaces it).",
    )


class DisaggregationSpec(_Spec):
    """Prefill/decode disaggregation (docs/architecture.md, "KV connector"): prefill engines compute each
    prompt's KV and first token, decode engines pull that KV and continue the stream."""

    prefill: DisaggregationRole = _default_obj(DisaggregationRole)
    decode: DisaggregationRole = _default_obj(DisaggregationRole)


def upstream(definition: str, **extra: Any) -> Any:
    """The CRD takes this field's schema from the Kubernetes OpenAPI (`crd.py` inlines it)."""
    return {K8S_SCHEMA_KEY: definition, **extra}


def _shaped(shape: Shape, what: str) -> AfterValidator:
    """Refuse the keys an upstream object does not have (the API server refuses them under kubectl's Strict
    field validation; the CRD carries the upstream schema, pydantic this shape of it)."""

    def check(value: Any) -> Any:
        if errors := unknown_fields(value, shape, what):
            raise ValueError("; ".join(errors))
        return value

    return AfterValidator(check)


def _check_tolerations(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    errors = [
        e
        for i, t in enumerate(value)
        for e in (
            unknown_fields(t, TOLERATION, f"tolerations[{i}]") or toleration_errors(t, f"tolerations[{i}]")
        )
    ]
    if errors:
        raise ValueError("; ".join(errors))
    return value


def _check_label_keys(value: dict[str, str]) -> dict[str, str]:
    if bad := [k for k in value if not re.fullmatch(LABEL_KEY_PATTERN, k)]:
        raise ValueError(f"nodeSelector keys {bad}: {NODE_SELECTOR_KEYS}")
    return value


NODE_SELECTOR_KEYS = (
    "a label key is a name of at most 63 characters (letters, digits, '-', '_', '.'; alphanumeric at both "
    "ends), optionally prefixed by a DNS subdomain and '/'"
)
LabelValue = Annotated[str, Field(max_length=LABEL_VALUE_MAX, pattern=LABEL_VALUE_PATTERN)]
# A name the API server checks as a DNS-1123 subdomain on the child ("" where the field is optional).
OptionalName = Annotated[str, Field(max_length=253, pattern=OPTIONAL_DNS1123_SUBDOMAIN)]


class SchedulingSpec(_Spec):
    node_selector: Annotated[dict[str, LabelValue], AfterValidator(_check_label_keys)] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels the engine pods require (label keys and values, as the Pod's nodeSelector).",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"self.all(k, k.matches('{LABEL_KEY_PATTERN}'))", f"nodeSelector: {NODE_SELECTOR_KEYS}")
            ]
        },
    )
    tolerations: Annotated[list[dict[str, Any]], AfterValidator(_check_tolerations)] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=upstream(
            "io.k8s.api.core.v1.Toleration", **{"x-kubernetes-validations": toleration_cel()}
        ),
    )
    affinity: Annotated[dict[str, Any], _shaped(AFFINITY, "affinity")] = Field(
        default_factory=dict, json_schema_extra=upstream("io.k8s.api.core.v1.Affinity")
    )
    topology_spread_constraints: Annotated[
        list[dict[str, Any]], _shaped((TOPOLOGY_SPREAD_CONSTRAINT,), "topologySpreadConstraints")
    ] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=upstream("io.k8s.api.core.v1.TopologySpreadConstraint"),
    )
    priority_class_name: OptionalName = ""
    runtime_class_name: OptionalName = ""


GPU_SAFE_ROLLOUT = (
    "RollingUpdate",
    "0",
    "1",
)  # no surge pod: it would wait Pending for a GPU the old pod holds
CPU_ROLLOUT = ("RollingUpdate", "1", "0")  # surge one pod, never below the ready count


class RolloutSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.strategy) || self.strategy != 'Recreate' || (!has(self.maxSurge) && "
                    "!has(self.maxUnavailable))",
                    "rollout.maxSurge and maxUnavailable apply to RollingUpdate only",
                ),
                cel(
                    "!has(self.maxSurge) || !has(self.maxUnavailable) || !(string(self.maxSurge) in ['0', '0%'] && "
                    "string(self.maxUnavailable) in ['0', '0%'])",
                    "rollout.maxSurge and maxUnavailable cannot both be 0 (no pod could ever be replaced)",
                ),
            ]
        }
    )
    strategy: Literal["RollingUpdate", "Recreate"] | None = Field(
        None,
        description="How pods are replaced on a spec change. Unset: RollingUpdate with maxSurge 0 and "
        "maxUnavailable 1 when resources.gpus > 0 (no surge pod waiting for a GPU on a full pool), else maxSurge 1 "
        "and maxUnavailable 0.",
    )
    max_surge: IntOrPercent | None = Field(None, description="Pods above replicas during a RollingUpdate.")
    max_unavailable: IntOrPercentTo100 | None = Field(
        None, description="Pods below replicas during a RollingUpdate."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutSpec:
        if self.strategy == "Recreate" and (self.max_surge is not None or self.max_unavailable is not None):
            raise ValueError("rollout.maxSurge and maxUnavailable apply to RollingUpdate only, not Recreate")
        if self.max_surge in ("0", "0%") and self.max_unavailable in ("0", "0%"):
            raise ValueError(
                "rollout.maxSurge and maxUnavailable cannot both be 0 (no pod could ever be replaced)"
            )
        return self

    def resolved(self, gpus: int) -> tuple[str, str | None, str | None]:
        """(strategy, maxSurge, maxUnavailable) in force: unset fields take the default for GPU or CPU pods,
        except that a default never makes both 0 next to a 0 the user set."""
        if self.strategy == "Recreate":
            return "Recreate", None, None
        _, surge, unavailable = GPU_SAFE_ROLLOUT if gpus > 0 else CPU_ROLLOUT
        zero = ("0", "0%")
        if self.max_surge is not None:
            surge = self.max_surge
            unavailable = self.max_unavailable or ("1" if surge in zero else unavailable)
        elif self.max_unavailable is not None:
            unavailable = self.max_unavailable
            surge = "1" if unavailable in zero else surge
        return "RollingUpdate", surge, unavailable


# Env variables, volumes and mount paths the operator renders itself: a pod-template entry may not reuse
# them (server-side apply refuses duplicate keys, and the engine depends on them).
RESERVED_ENV = (
    "SPECFLEET_ADMIN_TOKEN_FILE",
    "SPECFLEET_ADMIN_TOKEN",
    "SPECFLEET_CACHE",
    "SPECFLEET_SERVICE_NAME",
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRITON_CACHE_DIR",
    "SPECFLEET_POD_IP",
    "SPECFLEET_NODES",
    "SPECFLEET_NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
RESERVED_VOLUMES = ("tmp", "cache", "admin-token", "dshm", TUNED_CONFIG_VOLUME)
RESERVED_VOLUME_PREFIXES = ("model-", "draft-")
RESERVED_MOUNT_PATHS = (
    "/tmp",
    "/cache",
    "/dev/shm",
    "/var/run/secrets/specfleet/admin",
    TUNED_CONFIG_DIR,
    "/models/model",
    "/models/draft",
)


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


class PodTemplateSpec(_Spec):
    """What real clusters add to the engine pods; the operator's own fields keep precedence."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"!has(self.env) || self.env.all(e, !(e.name in {_cel_list(RESERVED_ENV)}))",
                    f"pod.env may not set the operator's own variables {', '.join(RESERVED_ENV)}",
                ),
                cel(
                    f"!has(self.volumes) || self.volumes.all(v, !(v.name in {_cel_list(RESERVED_VOLUMES)}) && "
                    + " && ".join(f"!v.name.startsWith('{p}')" for p in RESERVED_VOLUME_PREFIXES)
                    + ")",
                    f"pod.volumes may not use the operator's volume names {', '.join(RESERVED_VOLUMES)} or names "
                    f"starting with {' or '.join(RESERVED_VOLUME_PREFIXES)}",
                ),
                cel(
                    f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in {_cel_list(RESERVED_MOUNT_PATHS)}))",
                    f"pod.volumeMounts may not mount over the operator's paths {', '.join(RESERVED_MOUNT_PATHS)}",
                ),
            ]
        }
    )
    service_account_name: OptionalName = Field("", description="ServiceAccount of the engine pods.")
    automount_service_account_token: bool = Field(
        False,
        description="Mount the ServiceAccount's token (workload identity); the engine itself never uses it.",
    )
    image_pull_secrets: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=upstream("io.k8s.api.core.v1.LocalObjectReference"),
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels (the operator's win).")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    env: list[dict[str, Any]] = Field(
        default_factory=list, max_length=128, json_schema_extra=upstream("io.k8s.api.core.v1.EnvVar")
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list, max_length=16, json_schema_extra=upstream("io.k8s.api.core.v1.EnvFromSource")
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, json_schema_extra=upstream("io.k8s.api.core.v1.Volume")
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description="Mounts into the engine container.",
        json_schema_extra=upstream("io.k8s.api.core.v1.VolumeMount"),
    )

    @model_validator(mode="after")
    def _not_reserved(self) -> PodTemplateSpec:
        for e in self.env:
            if e.get("name") in RESERVED_ENV:
                raise ValueError(
                    f"pod.env name={e.get('name')!r} is one of the operator's own variables "
                    f"({', '.join(RESERVED_ENV)})"
                )
        for v in self.volumes:
            name = str(v.get("name", ""))
            if name in RESERVED_VOLUMES or name.startswith(RESERVED_VOLUME_PREFIXES):
                raise ValueError(
                    f"pod.volumes name={name!r} is the operator's ({', '.join(RESERVED_VOLUMES)}, "
                    f"{' or '.join(RESERVED_VOLUME_PREFIXES)}*)"
                )
        for m in self.volume_mounts:
            if m.get("mountPath") in RESERVED_MOUNT_PATHS:
                raise ValueError(
                    f"pod.volumeMounts mountPath={m.get('mountPath')!r} is the operator's "
                    f"({', '.join(RESERVED_MOUNT_PATHS)})"
                )
        return self


class SLOSpec(_Spec):
    ttft_p95_ms: int = Field(500, ge=1, le=600000, description="Time-to-first-token p95 target.")
    tpot_p95_ms: int = Field(50, ge=1, le=60000, description="Time-per-output-token p95 target.")


# The spec sections that hold a searched knob's start value (Knob.spec_path).
_KNOB_SECTIONS: dict[str, type[_Spec]] = {"speculative": SpeculativeSpec, "batching": BatchingSpec}


def knob_limits(knob: Knob) -> tuple[int, int]:
    """The [minimum, maximum] of the spec field that holds a searched knob (`speculative.numSpeculativeTokens`:
    [0, 16]): its autotune bounds and pin stay within them, so the tuner never pushes a value the field
    itself refuses."""
    section, name = (knob.spec_path or "").split(".")
    metadata = _KNOB_SECTIONS[section].model_fields[name].metadata
    low = next(m.ge for m in metadata if isinstance(m, Ge))
    high = next(m.le for m in metadata if isinstance(m, Le))
    return cast(int, low), cast(int, high)


def _bounds(knob: Knob) -> Any:
    """[min, max] for the tuner's search space: from the lowest value the admin API accepts to the most the
    knob's spec field does."""
    return Annotated[
        list[Annotated[int, Field(ge=knob.minimum, le=knob_limits(knob)[1])]],
        Field(min_length=2, max_length=2),
    ]


class _AutotuneBounds(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"self.{k.crd_name}[0] <= self.{k.crd_name}[1]",
                    f"bounds.{k.crd_name} must be [min, max] with min <= max",
                )
                for k in SEARCHED
            ]
        }
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> _AutotuneBounds:
        for name, (low, high) in self.model_dump(by_alias=True).items():
            if low > high:
                raise ValueError(f"autotune.bounds.{name}={[low, high]} must be [min, max] with min <= max")
        return self


# One [min, max] per searched knob, its default the declaration's (specfleet.engine.knobs).
if TYPE_CHECKING:
    AutotuneBounds = _AutotuneBounds
else:
    AutotuneBounds = create_model(
        "AutotuneBounds",
        __base__=_AutotuneBounds,
        **{k.name: (_bounds(k), list(k.search or ())) for k in SEARCHED},
    )


class _AutotunePins(_Spec):
    pass


# One optional value per searched knob: the tuner holds a pinned knob at that value and searches the others.
if TYPE_CHECKING:
    AutotunePins = _AutotunePins
else:
    AutotunePins = create_model(
        "AutotunePins",
        __base__=_AutotunePins,
        **{
            k.name: (
                int | None,
                Field(
                    None,
                    ge=k.minimum,
                    le=knob_limits(k)[1],
                    description=f"Hold {k.label} at this value (inside autotune.bounds); unset: tuned.",
                ),
            )
            for k in SEARCHED
        },
    )

FREEZE_ANNOTATION = "specfleet.io/tuner-freeze"


class AutotuneSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"!has(self.pins.{k.crd_name}) || (self.pins.{k.crd_name} >= self.bounds.{k.crd_name}[0] && "
                    f"self.pins.{k.crd_name} <= self.bounds.{k.crd_name}[1])",
                    f"pins.{k.crd_name} must lie inside bounds.{k.crd_name}",
                )
                for k in SEARCHED
            ]
        }
    )
    enabled: bool = False
    freeze: bool = Field(
        False,
        description="Hold the config in force: the tuner keeps observing and reporting, changes and pushes "
        f"nothing until this is false again. Without a Git change: annotate {FREEZE_ANNOTATION}=true.",
    )
    interval_seconds: int = Field(30, ge=5, le=3600)
    prometheus_url: str | None = Field(
        None,
        alias="prometheusURL",
        pattern=r"^https?://",
        max_length=512,
        description="Prometheus to read metrics from; empty means the operator's default.",
    )
    bounds: AutotuneBounds = _default_obj(AutotuneBounds)
    pins: AutotunePins = _default_obj(AutotunePins)

    @model_validator(mode="after")
    def _pins_within_bounds(self) -> AutotuneSpec:
        for knob in SEARCHED:
            pin, (low, high) = getattr(self.pins, knob.name), getattr(self.bounds, knob.name)
            if pin is not None and not low <= pin <= high:
                raise ValueError(
                    f"autotune.pins.{knob.crd_name}={pin} lies outside autotune.bounds."
                    f"{knob.crd_name}={[low, high]}; pin inside the bounds or widen them"
                )
        return self


# The placement and pull fields the router pods take from the engines' (spec.pod, spec.scheduling), each of
# which `routing.pod` may set for the router alone; the same field definitions (limits, schemas) as there.
ROUTER_POD_FIELDS = (
    (PodTemplateSpec, "image_pull_secrets"),
    (SchedulingSpec, "node_selector"),
    (SchedulingSpec, "tolerations"),
    (SchedulingSpec, "affinity"),
    (SchedulingSpec, "priority_class_name"),
)


def _unset_by_default(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """The field as it is, but with no default the API server would fill in (`priorityClassName: ""`), so
    that unset and set-to-empty stay apart."""
    annotation: Any = field.annotation
    if field.default_factory is not None:
        return annotation, field
    return annotation | None, FieldInfo.merge_field_infos(field, default=None)


class _RouterPodSpec(_Spec):
    """The router pods' placement: a field set here (even to empty) replaces the engines' value for the
    router pods; a field left unset takes it from spec.pod / spec.scheduling (docs/operator.md)."""

    def overrides(self) -> dict[str, Any]:
        """The fields set here, as the pod spec spells them (an empty value: none for the router)."""
        return self.model_dump(by_alias=True, include=self.model_fields_set)


if TYPE_CHECKING:
    RouterPodSpec = _RouterPodSpec
else:
    RouterPodSpec = create_model(
        "RouterPodSpec",
        __base__=_RouterPodSpec,
        __doc__=_RouterPodSpec.__doc__,
        **{name: _unset_by_default(model.model_fields[name]) for model, name in ROUTER_POD_FIELDS},
    )


# A model name as clients write it in `model` (OpenAI's and Hugging Face's: `org/name`, `name:tag`, dots).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
MODEL_NAME_MAX = 128
ALIASES_UNIQUE = "routing.aliases must not repeat a name"
_UNIQUE_ALIASES = "self.all(a, self.filter(b, b == a).size() == 1)"


class RoutingSpec(_Spec):
    enabled: bool = Field(
        True,
        description="Run the fleet router in front of the engines (the Service points at "
        "it; the engines get a headless Service). false: the Service spreads requests itself.",
    )
    policy: Literal[tuple(POLICIES)] = Field(  # type: ignore[valid-type]
        DEFAULT_POLICY,
        description="prefix: the engine estimated to hold the longest prefix of the prompt, "
        "bounded by load; least-loaded: fewest requests in flight; round-robin.",
    )
    load_factor_percent: int = Field(
        125,
        ge=100,
        le=1000,
        description="prefix policy: an engine takes a request only while its requests in "
        "flight stay within this percentage of the mean (consistent hashing with bounded loads).",
    )
    session_header: str = Field(
        "x-session-id",
        max_length=64,
        pattern=r"^[A-Za-z0-9-]*$",
        description="Requests with the same value of this header go to the same engine while its load allows "
        "(prefix policy); empty turns session affinity off.",
    )
    replicas: int = Field(
        2,
        ge=1,
        le=100,
        description="Router pods (stateless; each keeps its own prefix index). Two by default, on different "
        "nodes where the scheduler can: the router is in the path of every request, so one pod restarting "
        "(an operator upgrade rolls it, a node drain evicts it) must leave another serving.",
    )
    queue_timeout_seconds: int = Field(
        0,
        ge=0,
        le=3600,
        description="How long a request waits for a ready engine before 503 (scale from zero).",
    )
    image: str | None = Field(
        None, max_length=512, description="Router image; empty means the operator's own."
    )
    pod: RouterPodSpec = _default_obj(RouterPodSpec)
    aliases: list[
        Annotated[str, Field(min_length=1, max_length=MODEL_NAME_MAX, pattern=MODEL_NAME_PATTERN)]
    ] = Field(
        default_factory=list,
        max_length=16,
        description="Model names the gateway (`specfleet router --gateway`) also routes to this service, "
        "besides its own name; services sharing a name split its traffic by weight (a canary).",
        json_schema_extra={"x-kubernetes-validations": [cel(_UNIQUE_ALIASES, ALIASES_UNIQUE)]},
    )
    weight: int = Field(
        DEFAULT_WEIGHT,
        ge=0,
        le=MAX_WEIGHT,
        description="The gateway's share of a shared model name for this service, against the other "
        "services serving it (weight / sum of weights); 0 takes it out of the split. Requests with a session "
        "id stay on one service.",
    )

    @model_validator(mode="after")
    def _unique_aliases(self) -> RoutingSpec:
        if repeated := sorted({a for a in self.aliases if self.aliases.count(a) > 1}):
            raise ValueError(f"routing.aliases repeats {repeated}: {ALIASES_UNIQUE}")
        return self


class AutoscalingSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.minReplicas <= self.maxReplicas",
                    "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
                ),
            ]
        }
    )
    enabled: bool = Field(
        False,
        description="The tuner decides the replica count between minReplicas and "
        "maxReplicas from its goodput model (needs autotune.enabled). Leave it off when an HPA "
        "or KEDA drives the scale subresource: two controllers must not both set replicas.",
    )
    # The replica knob's range (specfleet.engine.knobs.REPLICAS): its default and its floor come from there.
    min_replicas: int = Field(
        REPLICAS.search[0] if REPLICAS.search else 1,
        ge=REPLICAS.minimum,
        le=1000,
        description="0 allows scale to zero: the router holds requests "
        "(routing.queueTimeoutSeconds) while the first pod starts.",
    )
    max_replicas: int = Field(
        REPLICAS.search[1] if REPLICAS.search else 1, ge=max(1, REPLICAS.minimum), le=1000
    )
    scale_up_stabilization_seconds: int = Field(
        0,
        ge=0,
        le=3600,
        description="A scale-up takes the lowest recommendation of this window (the HPA's default: 0).",
    )
    scale_down_stabilization_seconds: int = Field(
        300,
        ge=0,
        le=3600,
        description="A scale-down takes the highest recommendation of this window (the HPA's default: 300).",
    )
    cooldown_seconds: int = Field(
        60, ge=0, le=3600, description="No replica change this soon after the last one."
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas={self.min_replicas} must be <= autoscaling.maxReplicas="
                f"{self.max_replicas}"
            )
        return self


_WITHIN = "!self.autotune.enabled || (self.{path} >= self.autotune.bounds.{b}[0] && self.{path} <= self.autotune.bounds.{b}[1])"


def _start_path(knob: Knob) -> str:
    """Where the spec holds a searched knob's start value, as the CRD spells it (`batching.maxNumSeqs`)."""
    return ".".join(camel(part) for part in (knob.spec_path or "").split("."))


_TUNED = tuple((_start_path(k), k.crd_name) for k in SEARCHED)


class InferenceServiceSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.replicas >= 0", "replicas must be >= 0"),
                cel(
                    "!self.autoscaling.enabled || self.autotune.enabled",
                    "autoscaling.enabled needs autotune.enabled: replicas are the tuner's knob",
                ),
                cel(
                    "self.resources.gpus == 0 || self.resources.gpus * self.engine.nodes == "
                    "self.engine.tensorParallelSize * self.engine.pipelineParallelSize",
                    GPUS_PER_SPLIT,
                ),
                cel(
                    "self.model.quantization in ['none', 'int8'] || self.engine.tensorParallelSize == 1",
                    QUANTIZED_SPLIT,
                ),
                cel(
                    "!has(self.disaggregation) || (self.engine.tensorParallelSize == 1 && "
                    "self.engine.pipelineParallelSize == 1 && self.engine.nodes == 1)",
                    DISAGGREGATION_SPLIT,
                ),
                cel("!has(self.disaggregation) || self.routing.enabled", DISAGGREGATION_ROUTING),
                cel("!has(self.disaggregation) || self.replicas == 1", DISAGGREGATION_REPLICAS),
                cel(
                    "!self.autoscaling.enabled || self.autoscaling.minReplicas > 0 || "
                    "(self.routing.enabled && self.routing.queueTimeoutSeconds > 0)",
                    SCALE_TO_ZERO,
                ),
                cel(
                    "self.batching.maxNumBatchedTokens >= self.batching.maxNumSeqs",
                    "batching.maxNumBatchedTokens must be >= batching.maxNumSeqs (each sequence needs a token)",
                ),
                *[
                    cel(
                        _WITHIN.format(path=path, b=b),
                        f"with autotune enabled, {path} must lie inside autotune.bounds.{b}",
                    )
                    for path, b in _TUNED
                ],
            ]
        }
    )
    model: ModelSpec
    engine: EngineSpec = _default_obj(EngineSpec)
    batching: BatchingSpec = _default_obj(BatchingSpec)
    speculative: SpeculativeSpec = _default_obj(SpeculativeSpec)
    replicas: int = Field(
        1, ge=REPLICAS.minimum, le=1000
    )  # the replica knob's start value (REPLICAS.spec_path)
    disaggregation: DisaggregationSpec | None = Field(
        None, description="Split engines into prefill and decode roles; their replicas replace spec.replicas."
    )
    resources: ResourcesSpec = _default_obj(ResourcesSpec)
    scheduling: SchedulingSpec = _default_obj(SchedulingSpec)
    rollout: RolloutSpec = _default_obj(RolloutSpec)
    pod: PodTemplateSpec = _default_obj(PodTemplateSpec)
    slo: SLOSpec = _default_obj(SLOSpec)
    autotune: AutotuneSpec = _default_obj(AutotuneSpec)
    routing: RoutingSpec = _default_obj(RoutingSpec)
    autoscaling: AutoscalingSpec = _default_obj(AutoscalingSpec)

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceServiceSpec:
        b = self.batching
        if b.max_num_batched_tokens < b.max_num_seqs:
            raise ValueError(
                f"batching.maxNumBatchedTokens={b.max_num_batched_tokens} is below batching.maxNumSeqs="
                f"{b.max_num_seqs}; raise maxNumBatchedTokens or lower maxNumSeqs"
            )
        if self.autoscaling.enabled and not self.autotune.enabled:
            raise ValueError(
                "autoscaling.enabled needs autotune.enabled: replicas are the tuner's knob; "
                "turn autotune on, or autoscaling off and let an HPA/KEDA drive the scale subresource"
            )
        tp, pp, gpus = (
            self.engine.tensor_parallel_size,
            self.engine.pipeline_parallel_size,
            self.resources.gpus,
        )
        nodes = self.engine.nodes
        if nodes > 1 and (pp == 1 or pp % nodes):
            raise ValueError(f"engine.nodes={nodes} with pipelineParallelSize={pp}: {NODES_SPLIT}")
        if gpus != 0 and gpus * nodes != tp * pp:
            raise ValueError(
                f"resources.gpus={gpus} with tensorParallelSize={tp}, pipelineParallelSize={pp}, "
                f"nodes={nodes}: {GPUS_PER_SPLIT}"
            )
        if self.model.quantization not in ("none", "int8") and tp > 1:
            raise ValueError(f"model.quantization={self.model.quantization}: {QUANTIZED_SPLIT}")
        if self.disaggregation is not None:
            if tp * pp * nodes > 1:
                raise ValueError(
                    f"engine.tensorParallelSize={tp}, pipelineParallelSize={pp}, nodes={nodes}: "
                    f"{DISAGGREGATION_SPLIT}"
                )
            if not self.routing.enabled:
                raise ValueError(f"routing.enabled=false: {DISAGGREGATION_ROUTING}")
            if self.replicas != 1:
                raise ValueError(f"replicas={self.replicas}: {DISAGGREGATION_REPLICAS}")
        scaling, routing = self.autoscaling, self.routing
        if (
            scaling.enabled
            and scaling.min_replicas == 0
            and not (routing.enabled and routing.queue_timeout_seconds > 0)
        ):
            raise ValueError(
                f"routing.enabled={routing.enabled}, routing.queueTimeoutSeconds={routing.queue_timeout_seconds}: "
                f"{SCALE_TO_ZERO}"
            )
        if self.autotune.enabled:
            bounds = self.autotune.bounds.model_dump(by_alias=True)
            for knob, (path, key) in zip(SEARCHED, _TUNED, strict=True):
                value, (low, high) = self._at(knob), bounds[key]
                if not low <= value <= high:
                    raise ValueError(
                        f"{path}={value} lies outside autotune.bounds.{key}={[low, high]}; "
                        "change the value or widen the bounds"
                    )
        return self

    def _at(self, knob: Knob) -> int:
        node: Any = self
        for part in (knob.spec_path or "").split("."):
            node = getattr(node, part)
        return int(node)

    def _pinned(self, knob: Knob) -> bool:
        """k without a speculative method: the engine has no proposer, so k stays 0."""
        return knob.name == "num_speculative_tokens" and self.speculative.method == "none"

    def start_values(self) -> dict[str, int]:
        """Each searched knob's value at pod start, as the engine's command line sets it."""
        return {k.name: 0 if self._pinned(k) else self._at(k) for k in SEARCHED}

    def ceiling_values(self) -> dict[str, int]:
        """Each searched knob's ceiling flag (`Knob.ceiling_field`) as the engine's command line sets it: high
        enough for the tuner's bounds and the start value, so that no value the tuner may push is refused."""
        bounds, start = self.autotune.bounds.model_dump(), self.start_values()
        return {k.ceiling_field: max(bounds[k.name][1], start[k.name]) for k in SEARCHED}

    def tuned_bounds(self) -> dict[str, tuple[int, int]]:
        """The tuner's [min, max] per searched knob, from `autotune.bounds`; a knob in `autotune.pins` is
        [pin, pin], so the tuner moves it to the pin and never away."""
        ranges = {k.name: getattr(self.autotune.bounds, k.name) for k in SEARCHED}
        pins = {k.name: getattr(self.autotune.pins, k.name) for k in SEARCHED}

        def bounds(k: Knob) -> tuple[int, int]:
            if self._pinned(k):
                return (0, 0)
            pin = pins[k.name]
            return (pin, pin) if pin is not None else (ranges[k.name][0], ranges[k.name][1])

        return {k.name: bounds(k) for k in SEARCHED}
