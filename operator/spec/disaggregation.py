"""Prefill/decode disaggregation: the engine count of each role."""

from __future__ import annotations

from pydantic import Field

from .fields import _default_obj, _Spec


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
