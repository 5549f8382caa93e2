"""Request traces over OTLP/HTTP: where spans go, the exporter, the W3C context, the attribute names.

Shared by the engine server (engine/server/tracing.py) and the router (router/tracing.py, which imports this
one module of the engine: plain Python and opentelemetry, no torch). Traces are on when
`--otlp-traces-endpoint URL` (vLLM's flag) is given, else when the standard variables name a collector
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used as it is, or `OTEL_EXPORTER_OTLP_ENDPOINT`, to which
`/v1/traces` is added); `OTEL_SDK_DISABLED=true` turns them off. Off, nothing is built: no provider, no
exporter, no thread, and the request paths test one `None`. On, spans leave in batches from the SDK's
`BatchSpanProcessor` thread (its `OTEL_BSP_*` variables apply), over OTLP/HTTP protobuf only: this project
installs no gRPC exporter, so a `grpc` protocol is refused at start rather than silently sending nothing.

The SDK's global provider is never set: each process part holds its own provider, so a library that
installs another (an injected agent) does not take these spans over, and tests can run several.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_FLAG = "--otlp-traces-endpoint"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, added to a bare collector address
HTTP_PROTOCOL = "http/protobuf"

# Attribute names: OpenTelemetry's GenAI semantic conventions where they have one (the current names, and
# the older `prompt_tokens`/`completion_tokens` that vLLM still emits, so dashboards built on either work),
# vLLM's `gen_ai.latency.*` for the phases, `specfleet.*` for the rest.
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_ID = "gen_ai.request.id"
RESPONSE_ID = "gen_ai.response.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
TOP_K = "gen_ai.request.top_k"
N = "gen_ai.request.n"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens the prefix cache served
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
KV_TRANSFER_TIME = "gen_ai.latency.kv_cache_transfer_time"
TENANT = "specfleet.tenant"
SERVICE = "specfleet.service"  # the gateway's NAMESPACE/NAME of the InferenceService that answered
ENGINE = "specfleet.engine"  # the engine's URL, on the router's spans
KV_ROLE = "specfleet.kv.role"
KV_TRANSFER_ID = "specfleet.kv.transfer_id"
KV_PEER = "specfleet.kv.peer"
KV_BLOCKS_LOADED = "specfleet.kv.blocks_loaded"
KV_BLOCKS_SKIPPED = "specfleet.kv.blocks_skipped"
KV_BYTES = "specfleet.kv.bytes"
KV_FALLBACK = "specfleet.kv.fallback"

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate


def traces_endpoint(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP URL spans are sent to, or None when traces are off. ValueError names what is wrong."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if flag:
        url = _check_url(flag, ENDPOINT_FLAG)
        url = url.rstrip("/") + TRACES_PATH if urlsplit(url).path in ("", "/") else url
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        url = _check_url(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = _check_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"], "OTEL_EXPORTER_OTLP_ENDPOINT").rstrip("/")
        url += TRACES_PATH
    else:
        return None
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip()
        if protocol:
            if protocol != HTTP_PROTOCOL:
                raise ValueError(
                    f"{name}={protocol!r}: traces go out over OTLP/HTTP ({HTTP_PROTOCOL!r}) only; point "
                    f"{ENDPOINT_FLAG} at the collector's HTTP port (4318 by default) and unset {name}"
                )
            break  # the traces-specific variable wins over the general one
    return url


def _check_url(url: str, name: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{name}={url!r} must be an http:// or https:// URL of an OTLP/HTTP collector, e.g. "
            f"http://otel-collector:4318 (a gRPC endpoint such as :4317 is not served)"
        )
    return url.strip()


def make_provider(endpoint: str, service_name: str) -> Any:
    """A TracerProvider that batches spans to `endpoint` over OTLP/HTTP; `OTEL_SERVICE_NAME` and
    `OTEL_RESOURCE_ATTRIBUTES` override the default service name. The caller shuts it down (which flushes)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def extract(headers: Mapping[str, str]) -> Context:
    """The caller's span context from its `traceparent`/`tracestate` headers (an empty context without)."""
    return _PROPAGATOR.extract(headers)


def inject(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write `traceparent` (and `tracestate`) for `context` (default: the current one) into `headers`."""
    _PROPAGATOR.inject(headers, context)


def wall_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A `time.monotonic()` reading (any process of this host: one clock) as the Unix time in ns spans take."""
    offset = time.time_ns() - time.monotonic_ns() if offset_ns is None else offset_ns
    return int(monotonic_s * 1e9) + offset
