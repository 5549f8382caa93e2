"""The replica knob's range and the stabilization windows the tuner scales within."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator
from specfleet.engine.knobs import REPLICAS

from .fields import _Spec, cel


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
