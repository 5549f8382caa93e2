"""The InferenceService spec as pydantic models: the one source of truth for the CRD's spec schema.

`crds/inferenceservice.yaml` is generated from these classes (`python -m specfleet.operator.crd`), so a
field, default, enum, bound or CEL rule is written once, here. Cross-field rules are written twice on
purpose, side by side: as a CEL expression the API server enforces (`x-kubernetes-validations`) and as the
equivalent Python check pydantic runs for `specfleet up` (no API server there); the tests evaluate both on
the same table of invalid inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, model_validator
from pydantic.alias_generators import to_camel
from specfleet.engine.config import SPECULATIVE_METHODS
from specfleet.engine.knobs import SEARCHED, Knob, camel

SOURCE_PATTERN = r"^(bundled://[a-z0-9][a-z0-9.-]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.+|hf://[^/@\s]+/[^/@\s]+(@[^\s]+)?)$"
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"


def _quantity_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


# A Kubernetes resource quantity: YAML may write `cpu: 4` or `cpu: "500m"`.
Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    Field(
        pattern=QUANTITY_PATTERN,
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN},
    ),
]
# [min, max] pairs for the tuner's search space.
Bounds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]


def cel(rule: str, message: str) -> dict[str, str]:
    return {"rule": rule, "message": message}


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


def _default_obj(factory: type[_Spec]) -> Any:
    """An object field the API server defaults to `{}` so that its own fields' defaults apply."""
    return Field(default_factory=factory, json_schema_extra={"default": {}})


class ModelSource(_Spec):
    source: str = Field(
        pattern=SOURCE_PATTERN,
        max_length=512,
        description="Model URI: bundled://NAME, pvc://CLAIM/PATH, file:///ABS/PATH or hf://ORG/NAME[@REVISION].",
    )


class DraftModelSpec(ModelSource):
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="int8: the draft's weights as int8 on the engine's native CPU kernels (CPU pods). With "
        "source set to the target's own, a cheap draft that agrees with it on most tokens.",
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
        description="Secret (key HF_TOKEN) the hf:// download step reads, for gated models.",
    )


ONE_SPLIT = "engine.tensorParallelSize and engine.pipelineParallelSize: one split at a time (one of them must be 1)"
GPUS_PER_SPLIT = ("resources.gpus must be 0 (CPU ranks) or engine.tensorParallelSize x engine.pipelineParallelSize "
                  "(one GPU per rank)")
QUANTIZED_SPLIT = "model.quantization runs in one process: it needs tensorParallelSize and pipelineParallelSize 1"


class EngineSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [
            cel("self.tensorParallelSize == 1 || self.pipelineParallelSize == 1", ONE_SPLIT),
        ]}
    )
    image: str | None = Field(
        None, max_length=512, description="Engine image; empty means the operator's default engine image."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, description="KV cache block size in tokens.")
    kv_cache_memory_fraction: float = Field(0.9, ge=0.05, le=0.99)
    prefix_caching: bool = True
    tensor_parallel_size: int = Field(1, ge=1, le=8, description="Ranks one model copy is split over by tensor "
                                      "parallelism (one GPU each; processes sharing the CPU when gpus is 0).")
    pipeline_parallel_size: int = Field(1, ge=1, le=8, description="Pipeline stages one model copy is split into "
                                        "(one GPU each; processes sharing the CPU when gpus is 0).")
    drain_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="How long SIGTERM waits for in-flight requests before exiting."
    )
    startup_timeout_seconds: int = Field(
        900, ge=30, le=7200, description="How long the model may take to load before the pod is restarted."
    )
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64, description="Appended to the engine command line as given."
    )


class BatchingSpec(_Spec):
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences scheduled in one step.")
    max_num_batched_tokens: int = Field(2048, ge=16, le=1048576, description="Token budget of one step.")


class SpeculativeSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.method != 'draft' || has(self.draftModel)",
                    "method: draft needs draftModel.source (the small model that proposes tokens)"),
                cel("self.method == 'draft' || !has(self.draftModel)",
                    "draftModel is only used with method: draft; set method: draft or remove draftModel"),
            ]
        }
    )
    method: Literal[SPECULATIVE_METHODS] = "none"  # type: ignore[valid-type]
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="k: tokens proposed per step (0 = off).")
    disable_by_batch_size: int = Field(
        0, ge=0, le=4096,
        description="A step whose batch is larger than this proposes nothing (0 = never). With autotune on, "
                    "the tuner sets it to the batch at which it would turn speculation off itself (past the "
                    "step cost's knee), so a load that rises between two intervals loses no time to drafts.")
    draft_model: DraftModelSpec | None = None

    @model_validator(mode="after")
    def _draft_model_matches_method(self) -> SpeculativeSpec:
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative.method='draft' needs speculative.draftModel.source")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(
                f"speculative.draftModel is only used with method 'draft', not {self.method!r}; "
                "set method: draft or remove draftModel"
            )
        return self


class ResourcesSpec(_Spec):
    gpus: int = Field(1, ge=0, le=16, description="GPUs per replica; 0 runs the engine on CPU.")
    gpu_resource_name: str = Field("nvidia.com/gpu", pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$", max_length=253)
    cpu: Quantity = "4"
    memory: Quantity = "16Gi"
    shm_size: Quantity = Field("1Gi", description="Size of the in-memory /dev/shm volume.")


class DisaggregationRole(_Spec):
    replicas: int = Field(1, ge=1, le=1000, description="Engines of this role.")


class DisaggregationSpec(_Spec):
    """Prefill/decode disaggregation (docs/architecture.md, "KV connector"): prefill engines compute each
    prompt's KV and first token, decode engines pull that KV and continue the stream."""

    prefill: DisaggregationRole = _default_obj(DisaggregationRole)
    decode: DisaggregationRole = _default_obj(DisaggregationRole)


class SchedulingSpec(_Spec):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    affinity: dict[str, Any] = Field(default_factory=dict)
    priority_class_name: str = Field("", max_length=253)
    runtime_class_name: str = Field("", max_length=253)


class SLOSpec(_Spec):
    ttft_p95_ms: int = Field(500, ge=1, le=600000, description="Time-to-first-token p95 target.")
    tpot_p95_ms: int = Field(50, ge=1, le=60000, description="Time-per-output-token p95 target.")


class _AutotuneBounds(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"self.{k.crd_name}[0] <= self.{k.crd_name}[1]", f"bounds.{k.crd_name} must be [min, max] with min <= max")
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
        "AutotuneBounds", __base__=_AutotuneBounds,
        **{k.name: (Bounds, list(k.search or ())) for k in SEARCHED},
    )


class _AutotunePins(_Spec):
    pass


# One optional value per searched knob: the tuner holds a pinned knob at that value and searches the others.
if TYPE_CHECKING:
    AutotunePins = _AutotunePins
else:
    AutotunePins = create_model(
        "AutotunePins", __base__=_AutotunePins,
        **{k.name: (int | None, Field(None, ge=k.minimum, description=f"Hold {k.label} at this value "
                                      "(inside autotune.bounds); unset: tuned.")) for k in SEARCHED},
    )

FREEZE_ANNOTATION = "specfleet.io/tuner-freeze"


class AutotuneSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(f"!has(self.pins.{k.crd_name}) || (self.pins.{k.crd_name} >= self.bounds.{k.crd_name}[0] && "
                    f"self.pins.{k.crd_name} <= self.bounds.{k.crd_name}[1])",
                    f"pins.{k.crd_name} must lie inside bounds.{k.crd_name}")
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
                raise ValueError(f"autotune.pins.{knob.crd_name}={pin} lies outside autotune.bounds."
                                 f"{knob.crd_name}={[low, high]}; pin inside the bounds or widen them")
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
                cel("self.resources.gpus == 0 || "
                    "self.resources.gpus == self.engine.tensorParallelSize * self.engine.pipelineParallelSize",
                    GPUS_PER_SPLIT),
                cel("self.model.quantization == 'none' || "
                    "(self.engine.tensorParallelSize == 1 && self.engine.pipelineParallelSize == 1)", QUANTIZED_SPLIT),
                cel("self.batching.maxNumBatchedTokens >= self.batching.maxNumSeqs",
                    "batching.maxNumBatchedTokens must be >= batching.maxNumSeqs (each sequence needs a token)"),
                *[
                    cel(_WITHIN.format(path=path, b=b),
                        f"with autotune enabled, {path} must lie inside autotune.bounds.{b}")
                    for path, b in _TUNED
                ],
            ]
        }
    )
    model: ModelSpec
    engine: EngineSpec = _default_obj(EngineSpec)
    batching: BatchingSpec = _default_obj(BatchingSpec)
    speculative: SpeculativeSpec = _default_obj(SpeculativeSpec)
    replicas: int = Field(1, ge=0, le=1000)
    disaggregation: DisaggregationSpec | None = Field(
        None, description="Split engines into prefill and decode roles; their replicas replace spec.replicas.")
    resources: ResourcesSpec = _default_obj(ResourcesSpec)
    scheduling: SchedulingSpec = _default_obj(SchedulingSpec)
    slo: SLOSpec = _default_obj(SLOSpec)
    autotune: AutotuneSpec = _default_obj(AutotuneSpec)

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceServiceSpec:
        b = self.batching
        if b.max_num_batched_tokens < b.max_num_seqs:
            raise ValueError(
                f"batching.maxNumBatchedTokens={b.max_num_batched_tokens} is below batching.maxNumSeqs="
                f"{b.max_num_seqs}; raise maxNumBatchedTokens or lower maxNumSeqs"
            )
        tp, pp, gpus = self.engine.tensor_parallel_size, self.engine.pipeline_parallel_size, self.resources.gpus
        if tp > 1 and pp > 1:
            raise ValueError(f"engine.tensorParallelSize={tp}, pipelineParallelSize={pp}: {ONE_SPLIT}")
        if gpus not in (0, tp * pp):
            raise ValueError(f"resources.gpus={gpus} with tensorParallelSize={tp}, pipelineParallelSize={pp}: "
                             f"{GPUS_PER_SPLIT}")
        if self.model.quantization != "none" and tp * pp > 1:
            raise ValueError(f"model.quantization={self.model.quantization}: {QUANTIZED_SPLIT}")
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
