"""The router's spans (`--otlp-traces-endpoint`, or the OTEL_EXPORTER_OTLP_* variables: engine/tracing.py).

One tree per request, under the client's `traceparent` when it sent one:

    POST /v1/chat/completions (SERVER)  the gateway's or the router's: model, service, tenant, status
      prefill_request (CLIENT)          P/D: the prompt's leg to a prefill engine; the hold it made
        llm_request (the prefill engine's span: engine/server/tracing.py)
      route (INTERNAL)                  the policy's choice: engine, reason, prefix blocks matched,
                                        and the wait for a ready engine (scale from zero) when there was one
      engine_request (CLIENT)           the request's leg to the engine the policy chose (one per attempt)
        llm_request (the engine's span)

Each CLIENT span's context goes to its engine in `traceparent`, so the engine's span is its child. With
traces off the router holds no tracer (`Router.tracer` is None) and forwards the client's `traceparent`
untouched, so an engine that traces still joins the client's trace.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from opentelemetry import trace
from specfleet.engine import tracing
from specfleet.engine.tracing import ENDPOINT_FLAG, traces_endpoint

from .policies import Choice

if TYPE_CHECKING:
    from .front import FrontRequest, FrontResponse

logger = logging.getLogger("specfleet.router")
SERVICE_NAME = "specfleet-router"
_SPAN_KEY = web.RequestKey("specfleet_span", object)  # the request's SERVER span, once made
# The hooks other parts of the router fill in for the SERVER span, read when the request ends: the gateway
# sets the InferenceService that answered, the gateway's tenant gate (tenant_gate.py) the tenant's name.
SERVICE_KEY = web.RequestKey("specfleet_service", str)
TENANT_KEY = web.RequestKey("specfleet_tenant", str)

_CONTEXT_HEADERS = ("traceparent", "tracestate")  # the client's, replaced by the hop's own
T = TypeVar("T")
# The request's answer: aiohttp's, or the raw front's (router/front.py)
R = TypeVar("R", bound="web.StreamResponse | FrontResponse")
__all__ = ["ENDPOINT_FLAG", "SERVICE_KEY", "TENANT_KEY", "RouterTracer", "add_trace_flag", "traces_endpoint"]


def add_trace_flag(p: argparse.ArgumentParser, spans: str) -> None:
    """`--otlp-traces-endpoint` on a command that runs a router (`specfleet router`, `specfleet up`)."""
    p.add_argument(
        ENDPOINT_FLAG,
        default=None,
        metavar="URL",
        help=f"send {spans} to this OTLP/HTTP collector, e.g. http://otel-collector:4318 (/v1/traces is added "
        "to a bare address); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else no traces (docs/router.md, Traces)",
    )


class RouterTracer:
    """Spans for one router process (its gateway and every service's Router share it)."""

    # One tracer per collector in a process: `specfleet up -f a.yaml -f b.yaml` runs a Router per service
    # beside the gateway, and the spans of one request (the gateway's SERVER span, the service's route and
    # engine_request) must leave through one batch queue, in the order they ended; two providers would
    # send a parent before its children, or its children a batch later.
    _open: dict[str, RouterTracer] = {}

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("specfleet.router")
        self._users = 1
        self._endpoint: str | None = None

    @classmethod
    def from_endpoint(cls, endpoint: str) -> RouterTracer:
        """The process's tracer for `endpoint`, made on first use; each caller calls shutdown() once."""
        shared = cls._open.get(endpoint)
        if shared is not None:
            shared._users += 1
            return shared
        made = cls._open[endpoint] = cls(tracing.make_provider(endpoint, SERVICE_NAME))
        made._endpoint = endpoint
        return made

    async def serve(self, request: web.Request | FrontRequest, call: Callable[[], Awaitable[R]]) -> R:
        """`call()` inside the request's SERVER span; within one already made (the gateway's, then its
        service's router) it only calls."""
        if request.get(_SPAN_KEY) is not None:
            return await call()
        with self.tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=tracing.extract(request.headers),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        ) as span:
            request[_SPAN_KEY] = span
            request_id = request.headers.get("x-request-id")
            if request_id:
                span.set_attribute(tracing.REQUEST_ID, request_id)
            response = await call()
            span.set_attribute("http.response.status_code", response.status)
            for key, name in ((SERVICE_KEY, tracing.SERVICE), (TENANT_KEY, tracing.TENANT)):
                value = request.get(key)
                if value:
                    span.set_attribute(name, value)
            return response

    def note_body(self, body: Any) -> None:
        """What the request asked for, on the current (SERVER) span: the body as the gateway, then the
        service's router parsed it. The first `model` is the client's; a different one after it is the name
        the gateway rewrote it to, the one the engines serve."""
        if not isinstance(body, dict):
            return
        span = trace.get_current_span()
        model = body.get("model")
        if isinstance(model, str):
            asked = (getattr(span, "attributes", None) or {}).get(tracing.REQUEST_MODEL)
            span.set_attribute(tracing.REQUEST_MODEL if asked is None else tracing.RESPONSE_MODEL, model)
        span.set_attribute("specfleet.stream", bool(body.get("stream")))

    def routed(self, started: float, choice: Choice | None, policy: str, attempt: int) -> None:
        """The policy's decision as a `route` span from `started` (time.monotonic()) to now."""
        offset = time.time_ns() - time.monotonic_ns()
        attributes: dict[str, Any] = {"specfleet.route.policy": policy, "specfleet.route.attempt": attempt}
        if choice is None:
            attributes["specfleet.route.outcome"] = "no_engine"
        else:
            attributes.update(
                {
                    tracing.ENGINE: choice.url,
                    "specfleet.route.reason": choice.reason,
                    "specfleet.route.prefix_blocks": choice.match_blocks,
                }
            )
        span = self.tracer.start_span(
            "route", start_time=tracing.wall_ns(started, offset), attributes=attributes
        )
        span.end()

    async def hop(
        self,
        name: str,
        headers: Mapping[str, str],
        send: Callable[[dict[str, str]], Awaitable[T]],
        attributes: Mapping[str, Any],
    ) -> T:
        """`send(headers)` inside a CLIENT span `name`, the headers carrying its `traceparent`."""
        with self.tracer.start_as_current_span(
            name, kind=trace.SpanKind.CLIENT, attributes=dict(attributes)
        ) as span:
            traced = {k: v for k, v in headers.items() if k.lower() not in _CONTEXT_HEADERS}
            tracing.inject(traced)
            result = await send(traced)
            if name == "prefill_request":
                self._held(span, result)
            return result

    @staticmethod
    def _held(span: Any, held: Any) -> None:
        """The prefill leg's answer: the KV hold the decode engine will pull, or none (runs aggregated)."""
        if not isinstance(held, dict):
            span.set_attribute("specfleet.prefill.outcome", "aggregated")
            return
        span.set_attribute("specfleet.prefill.outcome", "held")
        for key, name in (("transfer_id", tracing.KV_TRANSFER_ID), ("num_blocks", "specfleet.kv.num_blocks")):
            if isinstance(held.get(key), (str, int)):
                span.set_attribute(name, held[key])
        span.set_attribute(tracing.KV_PEER, f"{held.get('remote_host')}:{held.get('remote_port')}")

    def answered(self, status: int, outcome: str, headers: Mapping[str, str]) -> None:
        """The engine's answer, on the current (CLIENT) span."""
        span = trace.get_current_span()
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("specfleet.outcome", outcome)
        engine_id = headers.get("x-request-id")
        if engine_id:
            span.set_attribute(tracing.RESPONSE_ID, engine_id)

    def shutdown(self) -> None:
        """Flush the spans still batched and stop the exporter, once its last user (from_endpoint) is done:
        the services of one `specfleet up` stop one after another, and the last to stop still has spans."""
        self._users -= 1
        if self._users > 0:
            return
        if self._endpoint is not None:
            RouterTracer._open.pop(self._endpoint, None)
        try:
            self.provider.shutdown()
        except Exception:  # a collector gone at exit must not turn a clean stop into a failure
            logger.exception("event=trace_shutdown_failed")
