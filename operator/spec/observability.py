"""Where the service's request traces go: the engines' and the router's OTLP/HTTP collector."""

from __future__ import annotations

from pydantic import Field

from .fields import _Spec

# An http(s) URL with a host, as engine/tracing.py's `traces_endpoint` accepts it (gRPC is not served).
OTLP_ENDPOINT_PATTERN = r"^https?://[^/\s]+(/\S*)?$"


class ObservabilitySpec(_Spec):
    otlp_traces_endpoint: str | None = Field(
        None,
        pattern=OTLP_ENDPOINT_PATTERN,
        max_length=2048,
        description="An OTLP/HTTP collector (e.g. http://otel-collector.observability:4318; /v1/traces is "
        "added to a bare address) that the engines and the router send each request's spans to: routing, "
        "queue, prefill, decode and the KV transfer, under the client's W3C traceparent. Unset: no traces.",
    )
