"""The tuner's objective and search space: the SLO targets, the bounds and pins of each searched knob
(generated from the knob declaration, within the limits of the spec field that holds its start value), freeze."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, cast

from annotated_types import Ge, Le
from pydantic import ConfigDict, Field, create_model, model_validator
from specfleet.engine.knobs import SEARCHED, Knob

from .engine import BatchingSpec
from .fields import _default_obj, _Spec, cel
from .speculative import SpeculativeSpec


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
