"""The whole InferenceService spec: its sections and the rules that span them (parallelism against GPUs,
quantization against tensor parallelism, disaggregation, scale to zero, start values inside the autotune bounds)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator
from specfleet.engine.knobs import REPLICAS, SEARCHED, Knob, camel

from .adapters import MAX_ADAPTERS, AdapterSpec, LoraSpec, adapter_rules, check_adapters
from .autoscaling import AutoscalingSpec
from .autotune import AutotuneSpec, SLOSpec
from .disaggregation import DisaggregationSpec
from .engine import NODES_SPLIT, BatchingSpec, EngineSpec
from .fields import _default_obj, _Spec, cel
from .model import ModelSpec
from .observability import ObservabilitySpec
from .placement import ResourcesSpec, SchedulingSpec
from .pod import PodTemplateSpec
from .rollout import RolloutSpec
from .routing import RoutingSpec
from .speculative import SpeculativeSpec

GPUS_PER_SPLIT = (
    "resources.gpus must be 0 (CPU ranks) or the GPUs of one pod: engine.tensorParallelSize x "
    "engine.pipelineParallelSize / engine.nodes (one GPU per rank)"
)
QUANTIZED_SPLIT = (
    "model.quantization gguf, awq and gptq pack weights in blocks with per-block scales that are "
    "not sliced by attention head: with them engine.tensorParallelSize must be 1 "
    "(pipelineParallelSize splits them into stages; int8 splits either way)"
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
                *adapter_rules(),
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
    observability: ObservabilitySpec = _default_obj(ObservabilitySpec)
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters on the model, each named by a request's `model` (docs/operator.md).",
    )
    lora: LoraSpec = _default_obj(LoraSpec)

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
        check_adapters(self.adapters, self.lora, tp, pp)
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
