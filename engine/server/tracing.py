"""The engine server's request spans: one `llm_request` per request, its phases as children.

As vLLM builds its `llm_request` span from a finished request's metrics (`vllm/v1/engine/output_processor.py`),
the span is made once the request has ended, from the times the engine core sent back with its tokens
(`SeqDelta.first_scheduled_time` and `kv_transfer`, `time.monotonic()` in the core, the same clock as the
server's): nothing is traced inside the core's loop, and a request holds only its caller's context and a
few attributes while it runs. The tree, under the caller's `traceparent` (a router's hop, or a client):

    llm_request (SERVER)   arrival -> finish; ids, model, sampling, usage, cache hits, latencies
      queue                arrival -> first scheduled (a remote-prefilled request: -> its KV pull)
      kv_transfer          the decode engine's pull of the prompt's KV (disaggregation only)
      prefill              first scheduled -> first token (not on a decode engine whose pull succeeded)
      decode               first token -> finish (on such a decode engine: first scheduled -> finish)

A prefill engine's span names the transfer it holds (`specfleet.kv.transfer_id`), and the decode engine's
the same id, so the two legs of one request meet in a trace viewer even without a router in front.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from specfleet.engine import tracing
from specfleet.engine.outputs import KVTransferMetrics
from specfleet.engine.sampling_params import SamplingParams

logger = logging.getLogger("specfleet.engine.server")
SERVICE_NAME = "specfleet-engine"


@dataclass
class RequestTrace:
    """What a running request keeps for its span: the caller's context and the attributes known at start."""

    context: Context
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    name: str
    start: float  # time.monotonic()
    end: float
    attributes: Mapping[str, Any] = field(default_factory=dict)


def phases(
    arrival: float,
    first_scheduled: float | None,
    first_token: float | None,
    finish: float,
    output_tokens: int,
    kv: KVTransferMetrics | None,
) -> list[Phase]:
    """The request's phases from its times (pure: tests/server/test_tracing_phases.py). A phase that did not
    happen (no token yet, an abort in the queue) is left out; each ends no earlier than it starts."""
    out: list[Phase] = []

    def add(name: str, start: float | None, end: float | None, **attributes: Any) -> None:
        if start is not None and end is not None:
            out.append(Phase(name, start, max(start, end), attributes))

    add("queue", arrival, kv.start if kv is not None else first_scheduled or finish)
    if kv is not None:
        add(
            "kv_transfer",
            kv.start,
            kv.end,
            **{
                tracing.KV_PEER: kv.peer,
                tracing.KV_BLOCKS_LOADED: kv.blocks_loaded,
                tracing.KV_BLOCKS_SKIPPED: kv.blocks_skipped,
                tracing.KV_BYTES: kv.bytes,
                tracing.KV_FALLBACK: kv.fallback,
            },
        )
    if kv is not None and not kv.fallback:  # the prompt's KV came over the wire: its first step decodes
        add("decode", first_scheduled or kv.end, finish)
        return out
    add("prefill", first_scheduled, first_token or (finish if first_scheduled is not None else None))
    if output_tokens > 1:
        add("decode", first_token, finish)
    return out


class RequestTracer:
    """The server's spans (one per process, `EngineCoreClient.tracer`); None there when traces are off."""

    def __init__(self, provider: Any, model_name: str, kv_role: str | None = None) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("specfleet.engine.server")
        self.model_name, self.kv_role = model_name, kv_role

    @classmethod
    def from_endpoint(cls, endpoint: str, model_name: str, kv_role: str | None = None) -> RequestTracer:
        return cls(tracing.make_provider(endpoint, SERVICE_NAME), model_name, kv_role)

    def start(
        self,
        headers: Mapping[str, str],
        operation: str,
        params: SamplingParams,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> RequestTrace:
        """A request's trace at its start (the HTTP handler): the caller's context and what it asked for."""
        attributes: dict[str, Any] = {
            tracing.OPERATION: operation,
            tracing.REQUEST_MODEL: self.model_name,
            tracing.RESPONSE_MODEL: self.model_name,
            tracing.N: params.n,
            tracing.TEMPERATURE: params.temperature,
            tracing.TOP_P: params.top_p,
        }
        if params.max_tokens is not None:
            attributes[tracing.MAX_TOKENS] = params.max_tokens
        if params.top_k > 0:
            attributes[tracing.TOP_K] = params.top_k
        if self.kv_role:
            attributes[tracing.KV_ROLE] = self.kv_role
        transfer_id = (kv_transfer_params or {}).get("transfer_id")
        if isinstance(transfer_id, str):  # a decode engine's request: the prefill engine's hold
            attributes[tracing.KV_TRANSFER_ID] = transfer_id
        return RequestTrace(tracing.extract(headers), attributes)

    def record(self, stream: Any) -> None:
        """The finished (or aborted) request's span tree, from its RequestStream; exported in the background."""
        trace_ = stream.trace
        if trace_ is None:
            return
        offset = time.time_ns() - time.monotonic_ns()
        end = stream.finish_time or time.monotonic()
        last = stream.last
        metrics = last.metrics if last is not None else None
        kv = metrics.kv_transfer if metrics is not None else None
        span = self.tracer.start_span(
            "llm_request",
            context=trace_.context,
            kind=trace.SpanKind.SERVER,
            start_time=tracing.wall_ns(stream.arrival, offset),
            attributes={**trace_.attributes, **self._finish_attributes(stream, kv)},
        )
        context = trace.set_span_in_context(span)
        for phase in phases(
            stream.arrival,
            metrics.first_scheduled_time if metrics is not None else None,
            stream.first_token_time,
            end,
            stream.max_sample_tokens,
            kv,
        ):
            child = self.tracer.start_span(
                phase.name,
                context=context,
                start_time=tracing.wall_ns(phase.start, offset),
                attributes=dict(phase.attributes),
            )
            child.end(end_time=tracing.wall_ns(phase.end, offset))
        span.end(end_time=tracing.wall_ns(end, offset))

    def _finish_attributes(self, stream: Any, kv: KVTransferMetrics | None) -> dict[str, Any]:
        last = stream.last
        reasons = [o.finish_reason for o in last.outputs if o.finish_reason] if last is not None else []
        attributes: dict[str, Any] = {
            tracing.REQUEST_ID: stream.request_id,
            tracing.RESPONSE_ID: stream.request_id,
            tracing.FINISH_REASONS: reasons or [stream.finish_reason or "abort"],
            tracing.INPUT_TOKENS: stream.prompt_tokens,
            tracing.PROMPT_TOKENS: stream.prompt_tokens,
            tracing.OUTPUT_TOKENS: stream.completion_tokens,
            tracing.COMPLETION_TOKENS: stream.completion_tokens,
            tracing.CACHED_TOKENS: stream.cached_tokens,
            tracing.E2E: stream.e2e,
        }
        if stream.queue_time is not None:
            attributes[tracing.TIME_IN_QUEUE] = stream.queue_time
        if stream.ttft is not None:
            attributes[tracing.TIME_TO_FIRST_TOKEN] = stream.ttft
        if kv is not None:
            attributes[tracing.KV_TRANSFER_TIME] = kv.end - kv.start
            attributes[tracing.KV_FALLBACK] = kv.fallback
        held = last.kv_transfer_params if last is not None else None
        if held and isinstance(held.get("transfer_id"), str):  # a prefill engine's: the hold it made
            attributes[tracing.KV_TRANSFER_ID] = held["transfer_id"]
        return attributes

    def shutdown(self) -> None:
        """Flush the spans still batched and stop the exporter (the server's exit)."""
        try:
            self.provider.shutdown()
        except Exception:  # a collector gone at exit must not turn a clean stop into a failure
            logger.exception("event=trace_shutdown_failed")


def start(
    tracer: RequestTracer | None,
    headers: Mapping[str, str],
    operation: str,
    params: SamplingParams,
    kv_transfer_params: Mapping[str, Any] | None,
) -> RequestTrace | None:
    """The handler's seam: None (and nothing done) when traces are off."""
    return None if tracer is None else tracer.start(headers, operation, params, kv_transfer_params)
