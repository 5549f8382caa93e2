"""The router's Prometheus metrics, in a registry of its own (one router per registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from specfleet.engine.knobs import REPLICAS

from .endpoints import EndpointSet


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Outcomes of a request (the `outcome` label): ok (2xx/3xx), client_error (4xx), engine_error (5xx
        # after retries), broken (the engine failed after the first byte was sent: never retried),
        # disconnected (the client went away; the engine's request was aborted), unavailable (no ready
        # engine: 503 + Retry-After).
        self.requests = Counter(
            "specfleet_router_requests", "Requests by engine and outcome", ["engine", "outcome"], registry=r
        )
        self.retries = Counter(
            "specfleet_router_retries",
            "Requests retried on another engine because this one failed before the first byte",
            ["engine"],
            registry=r,
        )
        self.resumed = Counter(
            "specfleet_router_resumed_streams",
            "Streams cut after their first byte (reason: broken connection, aborted by a draining engine, "
            "engine_dead) that went on from another engine (router/resume.py)",
            ["reason"],
            registry=r,
        )
        self.decisions = Counter(
            "specfleet_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self._add_prefix_metrics(r)
        self.endpoints = Gauge(
            "specfleet_router_endpoints", "Engines known to the router by state", ["state"], registry=r
        )
        self.in_flight = Gauge(
            "specfleet_router_in_flight",
            "Requests in flight through the router by engine",
            ["engine"],
            registry=r,
        )
        self.queued = Gauge(
            "specfleet_router_queued", "Requests waiting for a ready engine (scale from zero)", registry=r
        )
        self.cold_start = Gauge(
            "specfleet_router_cold_start_seconds",
            "How long the first request queued with "
            "no engine ready waited for one, at the last scale from zero",
            registry=r,
        )
        # The replica knob in force as the router sees it (specfleet.engine.knobs.REPLICAS): the engines it
        # knows that are not draining, ready or still starting (prefill engines apart).
        self.replicas = Gauge(REPLICAS.gauge, REPLICAS.help, registry=r)
        self.queue_wait = Histogram(
            "specfleet_router_queue_wait_seconds",
            "Time requests waited for a ready engine",
            registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )

    def _add_prefix_metrics(self, r: CollectorRegistry) -> None:
        """What the router's prefix index (estimate or exact) took each routed prompt to hold."""
        self.prefix_match = Histogram(
            "specfleet_router_prefix_match_tokens",
            "Estimated prompt tokens the chosen engine holds in its "
            "prefix cache (the router's index, in blocks times block size)",
            registry=r,
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096),
        )
        # The index's own hit rate, as the engines count theirs (specfleet_prefix_cache_hits / _queries):
        # per routing decision the prompt's full blocks (`prompt`) and the leading ones the chosen engine
        # is taken to hold (`matched`: the exact index's for an engine publishing KV events, else the
        # estimate's; 0 under a policy that keeps no index).
        self.prefix_blocks = Counter(
            "specfleet_router_prefix_blocks",
            "Prompt blocks routed (kind=prompt) and of those the chosen engine's index held (kind=matched)",
            ["kind"],
            registry=r,
        )
        # Chat requests by how their blocks were hashed (router/chat_template.py): `rendered` with the
        # model's chat template as the engine renders them (matched on the engines' KV events where they
        # publish), else the reason they were flattened and matched on the estimate (chat_template.REASONS)
        self.chat_prompts = Counter(
            "specfleet_router_chat_prompts",
            "Chat requests hashed with the model's chat template (outcome=rendered) or on the estimate "
            "(outcome: why the router could not render them as the engine does)",
            ["outcome"],
            registry=r,
        )

    def observe_endpoints(self, endpoints: EndpointSet) -> None:
        counts = {"ready": 0, "draining": 0, "not_ready": 0}
        for e in endpoints.all():
            counts["draining" if e.draining else "ready" if e.ready else "not_ready"] += 1
            self.in_flight.labels(e.url).set(e.outstanding)
        for state, n in counts.items():
            self.endpoints.labels(state).set(n)
        self.replicas.set(sum(1 for e in endpoints.all() if not e.draining and e.role != "prefill"))
