"""The InferenceService status as pydantic models (the CRD's status schema is generated from them).

The operator's reconcile owns `observedGeneration`, `conditions` of type Ready/Progressing/Degraded,
`replicas`, `readyReplicas`, `selector` and `endpoint`; the tuner owns `status.tuning`, the `Tuned`
condition and, with autoscaling on, `status.autoscaling`; the adapter sync (operator/adapters.py)
`status.adapters` and the `AdaptersReady` condition. Unknown condition types are kept as they are by whoever writes the list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.alias_generators import to_camel
from specfleet.engine.knobs import KNOBS, REPLICAS


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    type: str = Field(max_length=64, description="Ready, Progressing, Degraded or Tuned.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field("", max_length=128, description="CamelCase reason.")
    message: str = Field("", max_length=4096)
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = None


class TuningObserved(_Status):
    acceptance_rate: float | None = None
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    goodput: float | None = None
    request_rate: float | None = None


class AcceptanceWindow(_Status):
    demand: float | None = None
    per_pos: list[float] = Field(default_factory=list, max_length=64)
    share: float = 0.0
    age_seconds: float = 0.0
    shadow: bool = Field(
        False, description="Measured by the engines' shadow drafts (speculation off), not by verified drafts."
    )


class TuningResume(_Status):
    """What the tuner learned, so that a restarted operator continues (tuner/policy/resume.py)."""

    spec_hash: str = Field("", max_length=64, description="The spec fields the tuner depends on, hashed.")
    cost_points: list[list[float]] = Field(
        default_factory=list, max_length=64, description="(decode tokens, prefill tokens, seconds) per step."
    )
    plain_cost_points: list[list[float]] = Field(default_factory=list, max_length=64)
    acceptance: list[AcceptanceWindow] = Field(default_factory=list, max_length=32)


class _TuningStatus(_Status):
    last_decision_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    reason: str | None = Field(None, max_length=4096)
    frozen_by: str | None = Field(
        None,
        max_length=256,
        description="Set while the tuner is frozen: "
        "spec.autotune.freeze or the specfleet.io/tuner-freeze annotation.",
    )
    observed: TuningObserved | None = None
    resume: TuningResume | None = None
    changes_this_load: int | None = Field(
        None,
        ge=0,
        description="Config changes (reverts and reverted probes included) since the load last "
        "moved; the policy keeps it at most autotune's change budget per load level (2).",
    )


# The value in force of every live knob (specfleet.engine.knobs), then the tuner's last decision.
_TUNING_KNOBS: dict[str, Any] = {knob.name: (int | None, None) for knob in KNOBS}
if TYPE_CHECKING:
    TuningStatus = _TuningStatus
else:
    TuningStatus = create_model(
        "TuningStatus",
        __base__=_Status,
        **_TUNING_KNOBS,
        **{name: (f.annotation, f) for name, f in _TuningStatus.model_fields.items()},
    )


class _AutoscalingStatus(_Status):
    """Written by the tuner when `spec.autoscaling.enabled`: the replica count the reconcile renders into
    the Deployment (the operator never writes `spec.replicas`), and why."""

    replicas: int | None = Field(None, ge=0)  # for the type checker; the model below takes it from REPLICAS
    reason: str | None = Field(None, max_length=4096)
    last_scale_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    cold_start_seconds: float | None = Field(
        None,
        ge=0,
        description="Scale from zero: how long the first request the router queued waited for a "
        "ready engine (the router's measurement), at the last scale-up from zero.",
    )


# The replica knob's field is named, and bounded below, by its declaration (specfleet.engine.knobs.REPLICAS).
if TYPE_CHECKING:
    AutoscalingStatus = _AutoscalingStatus
else:
    AutoscalingStatus = create_model(
        "AutoscalingStatus",
        __base__=_Status,
        __doc__=_AutoscalingStatus.__doc__,
        **{REPLICAS.name: (int | None, Field(None, ge=REPLICAS.minimum))},
        **{
            name: (f.annotation, f)
            for name, f in _AutoscalingStatus.model_fields.items()
            if name != REPLICAS.name
        },
    )


class AdapterFailure(_Status):
    name: str = Field(max_length=63)
    message: str = Field("", max_length=1024, description="The engine's answer to the load.")


class PodAdapters(_Status):
    pod: str = Field(max_length=253)
    loaded: list[str] = Field(default_factory=list, max_length=64, description="Adapters the engine serves.")
    failed: list[AdapterFailure] = Field(default_factory=list, max_length=64)
    error: str | None = Field(None, max_length=1024, description="The engine could not be asked.")


class InferenceServiceStatus(_Status):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int | None = None
    ready_replicas: int | None = None
    selector: str | None = Field(None, description="Label selector of the pods (for the scale subresource).")
    endpoint: str | None = None
    tuning: TuningStatus | None = None
    autoscaling: AutoscalingStatus | None = None
    adapters: list[PodAdapters] | None = Field(
        None,
        max_length=1000,
        description="Per ready engine pod, the LoRA adapters it serves (spec.adapters).",
    )
