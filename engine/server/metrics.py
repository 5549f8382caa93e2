"""Prometheus metrics with exactly the DESIGN.md names, each labelled `model_name`.

Step metrics are fed from `engine.stats` after every step (engine thread); request metrics from the
front end's timestamps when a request finishes. prometheus-client is thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from specfleet.engine.knobs import KNOBS, LiveConfig
from specfleet.engine.spec_decode.request_classes import METRIC_PREFIX
from specfleet.engine.stats import EngineStats

from .protocol_metrics import ProtocolMetrics

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
# Why a request was turned away before the engine took it: 429 queue_full (`--max-waiting` requests wait),
# 503 draining (SIGTERM received) or 503 not_ready (the model is still loading). The `code` of the error body.
REFUSAL_REASONS = ("queue_full", "draining", "not_ready")
# Distinct `field` labels of specfleet_ignored_request_fields_total: clients choose the names, so the series
# are capped (vLLM's request protocol has about 60 fields; SDKs add a handful). Later names count as "other".
MAX_IGNORED_FIELD_LABELS = 100
# Ignored names remembered so each is logged once: 10,000 names of at most 64 characters stay under 1 MB;
# past that, new names are counted but not logged.
MAX_IGNORED_FIELD_NAMES_LOGGED = 10_000

_COUNTERS = {  # name without _total -> (help, EngineStats attribute)
    "specfleet_prompt_tokens": ("Prompt tokens computed", "prompt_tokens"),
    "specfleet_generation_tokens": ("Generated tokens", "generation_tokens"),
    "specfleet_num_preemptions": ("Requests preempted (recompute)", "num_preemptions"),
    "specfleet_num_priority_preemptions": (
        "Of those, running requests displaced by a waiting one of higher priority (--scheduling-policy priority)",
        "num_priority_preemptions",
    ),
    "specfleet_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    "specfleet_prefix_cache_hits": ("Prompt tokens found in the prefix cache", "prefix_cache_hits"),
    "specfleet_spec_decode_drafts": ("Speculative drafts verified", "num_drafts"),
    "specfleet_spec_decode_draft_tokens": ("Speculative tokens proposed", "num_draft_tokens"),
    "specfleet_spec_decode_accepted_tokens": ("Speculative tokens accepted", "num_accepted_tokens"),
    "specfleet_spec_decode_shadow_lookups": (
        "N-gram lookups scored on steps that verified no drafts (found a draft or not)",
        "shadow_lookups",
    ),
    "specfleet_spec_decode_shadow_drafts": (
        "Of the shadow lookups, those that found a draft",
        "shadow_drafts",
    ),
}
_PER_POSITION = {  # name without _total -> (help, EngineStats attribute: a list indexed by draft position)
    "specfleet_spec_decode_accepted_tokens_per_pos": (
        "Accepted speculative tokens by draft position",
        "accepted_per_pos",
    ),
    "specfleet_spec_decode_shadow_accepted_tokens_per_pos": (
        "Shadow drafts whose tokens up to this position all came out (what verification would accept)",
        "shadow_accepted_per_pos",
    ),
}

# Finished requests' speculation by class of acceptance (engine/spec_decode/request_classes.py), label `class`:
# 0 for a request that verified no draft, else 1 + the tenth of its draft tokens accepted (10: 0.9-1.0)
_PER_CLASS = {  # RequestCounts attribute (`COUNTED`, in its order) -> help
    "requests": "Finished requests by class of acceptance",
    "decode_steps": "Their steps that sampled a token after the first, by class of acceptance",
    "drafts": "Their drafts verified, by class of acceptance",
    "draft_tokens": "Their draft tokens, by class of acceptance",
}
PER_CLASS_POSITION = METRIC_PREFIX + "accepted_tokens_per_pos"


class ServerMetrics:
    # The same gauges under the names an endpoint picker reads (GIE's model-server protocol); the server
    # adds them (build_state), a ServerMetrics of its own (the router's tests) goes without.
    protocol: ProtocolMetrics | None = None
    # A finished request's (adapter, TTFT, TPOT, output tokens) for the per-adapter series: the server sets
    # it with --enable-lora (LoraMetrics.observe_request); without, requests on adapters count only here.
    on_lora_request: Callable[[str, float | None, float | None, int], None] | None = None

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, registry=r, buckets=buckets)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r)

        self.ttft = hist("specfleet_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.tpot = hist(
            "specfleet_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            TOKEN_LATENCY_BUCKETS,
        )
        self.itl = hist(
            "specfleet_inter_token_latency_seconds", "Time between streamed outputs", TOKEN_LATENCY_BUCKETS
        )
        self.e2e = hist(
            "specfleet_e2e_request_latency_seconds", "Request latency, arrival to finish", LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "specfleet_request_queue_time_seconds", "Time from arrival to first scheduling", LATENCY_BUCKETS
        )
        self.step_duration = hist("specfleet_step_duration_seconds", "Engine step duration", STEP_BUCKETS)
        self.batch_size = hist("specfleet_batch_size", "Sequences per engine step", BATCH_BUCKETS)
        self._add_step_parts(r, label)
        self.running = gauge("specfleet_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("specfleet_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("specfleet_kv_cache_usage_ratio", "Fraction of KV cache blocks in use")
        self.live = {knob.name: gauge(knob.gauge, knob.help) for knob in KNOBS}  # one gauge per live knob
        self.counters = {
            attr: Counter(name, doc, label, registry=r) for name, (doc, attr) in _COUNTERS.items()
        }
        self.success = Counter(
            "specfleet_request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.refused = Counter(
            "specfleet_requests_refused",
            "Requests refused before admission (429 or 503), by reason: " + ", ".join(REFUSAL_REASONS),
            ["model_name", "reason"],
            registry=r,
        )
        self.ignored_fields = Counter(
            "specfleet_ignored_request_fields",
            "Requests that carried a field this server accepts and ignores (an unknown one), by field name",
            ["model_name", "field"],
            registry=r,
        )
        self.per_position = {
            attr: Counter(name, doc, ["model_name", "position"], registry=r)
            for name, (doc, attr) in _PER_POSITION.items()
        }
        self._seen: dict[str, int] = {attr: 0 for attr in self.counters}
        self._seen_per_pos: dict[str, list[int]] = {attr: [] for attr in self.per_position}
        self._add_class_counters(r)
        self._ignored_logged: set[str] = set()
        self._ignored_labels: set[str] = set()
        self._create_series(model_name)

    def _add_step_parts(self, r: CollectorRegistry, label: list[str]) -> None:
        """The steps' parts bench sim reads apart. The steps that computed no prompt token (decode and
        verification only), with what they held, so that a step's cost can be read for decode and for
        prefill apart (bench sim calibrates each); and the core loop's time between back-to-back steps
        (EngineStats.step_gap_s), the serving path's share of a step's period on a host with fewer cores
        than its processes want."""
        self.decode_step_duration = Histogram(
            "specfleet_decode_step_duration_seconds",
            "Engine step duration, of the steps that computed no prompt token",
            label,
            registry=r,
            buckets=STEP_BUCKETS,
        )
        self.decode_step_counters = {
            attr: Counter("specfleet_decode_step_" + attr, doc, label, registry=r)
            for attr, doc in (
                ("sequences", "Sequences in the steps that computed no prompt token"),
                ("draft_tokens", "Speculative tokens proposed in the steps that computed no prompt token"),
                ("drafts", "Speculative drafts verified in the steps that computed no prompt token"),
            )
        }
        self.step_gap = Counter(
            "specfleet_step_gap_seconds",
            "Engine core seconds between back-to-back steps, outside the steps",
            label,
            registry=r,
        )
        self._seen_step_gap = 0.0

    def _create_series(self, model_name: str) -> None:
        """Every series exists from the first scrape (a rate over a series that appears late misses its first
        increments)."""
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        for reason in REFUSAL_REASONS:
            self.refused.labels(model_name, reason)
        for metric in (
            *self.counters.values(),
            self.ttft,
            self.tpot,
            self.itl,
            self.e2e,
            self.queue_time,
            self.step_duration,
            self.batch_size,
            self.decode_step_duration,
            *self.decode_step_counters.values(),
            self.step_gap,
            self.running,
            self.waiting,
            self.kv_usage,
            *self.live.values(),
        ):
            metric.labels(model_name)  # every series exists from the first scrape

    def _add_class_counters(self, r: CollectorRegistry) -> None:
        """Speculation per class of request acceptance (engine/spec_decode/request_classes.py), and what of
        the engine's cumulative class counts the series already carry."""
        self.per_class = {
            attr: Counter(METRIC_PREFIX + attr, doc, ["model_name", "class"], registry=r)
            for attr, doc in _PER_CLASS.items()
        }
        self.per_class_position = Counter(
            PER_CLASS_POSITION,
            "Their drafts whose first position + 1 tokens were accepted, by class of acceptance",
            ["model_name", "class", "position"],
            registry=r,
        )
        self._seen_class_requests = 0  # finished requests counted in a class: the classes move only with it
        self._seen_class: dict[tuple[str, int], int] = {}
        self._seen_class_pos: dict[tuple[int, int], int] = {}

    def observe_step(
        self, stats: EngineStats, stepped: bool, extra_waiting: int = 0, kv_usage: float | None = None
    ) -> None:
        """Called by the engine thread after each step (stepped=True) or when it goes idle."""
        m = self.model_name
        step = stats.last_step
        if stepped:
            self.step_duration.labels(m).observe(step.duration_s)
            if step.batch_size:
                self.batch_size.labels(m).observe(step.batch_size)
            if step.batch_size and not step.prompt_tokens:
                self.decode_step_duration.labels(m).observe(step.duration_s)
                decode = self.decode_step_counters
                decode["sequences"].labels(m).inc(step.batch_size)
                decode["draft_tokens"].labels(m).inc(step.num_draft_tokens)
                decode["drafts"].labels(m).inc(step.num_drafts)
        if stats.step_gap_s > self._seen_step_gap:
            self.step_gap.labels(m).inc(stats.step_gap_s - self._seen_step_gap)
            self._seen_step_gap = stats.step_gap_s
        running = step.num_running if stepped else 0
        waiting = (step.num_waiting if stepped else 0) + extra_waiting
        usage = step.kv_cache_usage if kv_usage is None else kv_usage
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(usage)
        if self.protocol is not None:
            self.protocol.observe(running, waiting, usage)
        for attr, counter in self.counters.items():
            total = int(getattr(stats, attr, 0) or 0)
            if total > self._seen[attr]:
                counter.labels(m).inc(total - self._seen[attr])
                self._seen[attr] = total
        for attr, counter in self.per_position.items():
            seen = self._seen_per_pos[attr]
            for pos, total in enumerate(getattr(stats, attr)):
                if pos >= len(seen):
                    seen.append(0)
                    counter.labels(m, str(pos))  # a position drafted and never accepted reads 0, not absent
                if total > seen[pos]:
                    counter.labels(m, str(pos)).inc(total - seen[pos])
                    seen[pos] = total
        self._observe_classes(stats)

    def _observe_classes(self, stats: EngineStats) -> None:
        """The per-class counters, when a request finished into a class since the last step."""
        finished = sum(c.requests for c in stats.request_classes)
        if finished == self._seen_class_requests:
            return
        self._seen_class_requests = finished
        m = self.model_name
        for cls, counts in enumerate(stats.request_classes):
            for attr, counter in self.per_class.items():
                total, seen = getattr(counts, attr), self._seen_class.get((attr, cls), 0)
                if total > seen:
                    counter.labels(m, str(cls)).inc(total - seen)
                    self._seen_class[(attr, cls)] = total
            for pos, total in enumerate(counts.accepted_per_pos):
                seen = self._seen_class_pos.setdefault((cls, pos), 0)
                counter = self.per_class_position.labels(
                    m, str(cls), str(pos)
                )  # a position never accepted: 0
                if total > seen:
                    counter.inc(total - seen)
                    self._seen_class_pos[(cls, pos)] = total

    def refuse(self, reason: str) -> None:
        """Count one request answered 429/503 before admission; `reason` is one of REFUSAL_REASONS."""
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"refusal reason {reason!r} is not one of {REFUSAL_REASONS}")
        self.refused.labels(self.model_name, reason).inc()

    def ignore_field(self, field: str) -> bool:
        """Count one request that carried the ignored `field`; True the first time the name is seen (the
        caller logs it then). Past MAX_IGNORED_FIELD_LABELS names, new ones count under "other"."""
        first = (
            field not in self._ignored_logged and len(self._ignored_logged) < MAX_IGNORED_FIELD_NAMES_LOGGED
        )
        if first:
            self._ignored_logged.add(field)
        if field not in self._ignored_labels and len(self._ignored_labels) >= MAX_IGNORED_FIELD_LABELS:
            field = "other"
        self._ignored_labels.add(field)
        self.ignored_fields.labels(self.model_name, field).inc()
        return first

    def set_live_config(self, config: LiveConfig) -> None:
        for name, value in config.as_dict().items():
            self.live[name].labels(self.model_name).set(value)

    def observe_request(
        self,
        *,
        finish_reason: str,
        ttft: float | None,
        e2e: float,
        queue_time: float | None,
        itls: list[float],
        tpot: float | None,
        lora_name: str | None = None,
        output_tokens: int = 0,
    ) -> None:
        m = self.model_name
        self.success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        if queue_time is not None:
            self.queue_time.labels(m).observe(queue_time)
        if tpot is not None:
            self.tpot.labels(m).observe(tpot)
        for gap in itls:
            self.itl.labels(m).observe(gap)
        if lora_name is not None and self.on_lora_request is not None:
            self.on_lora_request(lora_name, ttft, tpot, output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
