"""LoRA metrics: vLLM's `vllm:lora_requests_info` gauge, and specfleet's adapter loads, evictions and load
time. Read from the engine core (`lora_state`) when /metrics is scraped, into the server's registry.

vLLM encodes adapter activity in labels: one sample whose labels are `max_lora`, `running_lora_adapters`
and `waiting_lora_adapters` (comma-joined names of adapters with requests in flight) and whose value is
the wall-clock time it was taken; a reader takes the latest sample (the GIE endpoint picker does).

With speculative decoding, the draft proposes without the adapter and the target verifies with it, so
acceptance differs by adapter: `specfleet_lora_spec_decode_draft_tokens_total` and
`..._accepted_tokens_total`, the per-adapter split of `specfleet_spec_decode_{draft,accepted}_tokens_total`,
labelled `lora_name`. The tuner's goodput per adapter reads each adapter's finished requests:
`specfleet_lora_generation_tokens_total` (their output tokens) and `specfleet_lora_time_to_first_token_seconds`
and `specfleet_lora_time_per_output_token_seconds`, the engine-wide histograms' per-adapter split (same
buckets), recorded when a request finishes. Only served adapters have series (bounded by what the operator
loads: a request naming another is refused); an unloaded adapter's series are removed at the next scrape,
and a name loaded again starts from zero.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .metrics import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS

# Adapter reads run from a millisecond (a small adapter in the page cache) to seconds (a large one on a
# network volume): one bucket per doubling-ish, as the other latency histograms.
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoraMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int) -> None:
        self.model_name, self.max_loras = model_name, max_loras
        self.info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (value: when the sample was taken).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry,
        )
        label = ["model_name"]
        self.loads = Counter(
            "specfleet_lora_adapter_loads", "LoRA adapter loads (files read)", label, registry=registry
        )
        self.evictions = Counter(
            "specfleet_lora_adapter_evictions",
            "LoRA adapters evicted from host memory (--max-cpu-loras)",
            label,
            registry=registry,
        )
        self.load_seconds = Histogram(
            "specfleet_lora_adapter_load_seconds",
            "LoRA adapter load time",
            label,
            registry=registry,
            buckets=LOAD_BUCKETS,
        )
        spec_labels = ["model_name", "lora_name"]
        self.draft_tokens = Counter(
            "specfleet_lora_spec_decode_draft_tokens",
            "Speculative tokens proposed to requests on a LoRA adapter (the draft runs without it)",
            spec_labels,
            registry=registry,
        )
        self.accepted_tokens = Counter(
            "specfleet_lora_spec_decode_accepted_tokens",
            "Speculative tokens accepted for requests on a LoRA adapter",
            spec_labels,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "specfleet_lora_generation_tokens",
            "Output tokens of finished requests on a LoRA adapter",
            spec_labels,
            registry=registry,
        )
        self.ttft = Histogram(
            "specfleet_lora_time_to_first_token_seconds",
            "Time to first token of requests on a LoRA adapter",
            spec_labels,
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "specfleet_lora_time_per_output_token_seconds",
            "Mean time per output token after the first, per request on a LoRA adapter",
            spec_labels,
            registry=registry,
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self._requests: set[str] = set()  # adapters with request series
        self._loads = self._evictions = 0
        self._drafts: dict[str, tuple[int, int]] = {}  # adapter -> the engine's totals at the last scrape

    def update(self, state: dict[str, Any]) -> None:
        """From the engine core's `lora_state`: the counters move by what changed since the last scrape."""
        m = self.model_name
        self.info.clear()
        self.info.labels(str(self.max_loras), ",".join(state["running"]), ",".join(state["waiting"])).set(
            time.time()
        )
        self.loads.labels(m).inc(state["loads"] - self._loads)
        self.evictions.labels(m).inc(state["evictions"] - self._evictions)
        self._loads, self._evictions = state["loads"], state["evictions"]
        for seconds in state["load_s"]:
            self.load_seconds.labels(m).observe(seconds)
        self._update_drafts(state.get("drafts", {}))
        served = state.get("adapters", {})
        for name in [n for n in self._requests if n not in served]:  # unloaded: its series go with it
            for metric in (self.generation_tokens, self.ttft, self.tpot):
                metric.remove(m, name)
            self._requests.discard(name)

    def observe_request(self, lora_name: str, ttft: float | None, tpot: float | None, tokens: int) -> None:
        """One finished request on `lora_name` (ServerMetrics.on_lora_request)."""
        m = self.model_name
        if lora_name not in self._requests:  # every series of the adapter exists from its first request
            for metric in (self.generation_tokens, self.ttft, self.tpot):
                metric.labels(m, lora_name)
            self._requests.add(lora_name)
        self.generation_tokens.labels(m, lora_name).inc(tokens)
        if ttft is not None:
            self.ttft.labels(m, lora_name).observe(ttft)
        if tpot is not None:
            self.tpot.labels(m, lora_name).observe(tpot)

    def _update_drafts(self, drafts: dict[str, list[int]]) -> None:
        m = self.model_name
        for name in [n for n in self._drafts if n not in drafts]:  # unloaded: its series go with it
            self.draft_tokens.remove(m, name)
            self.accepted_tokens.remove(m, name)
            del self._drafts[name]
        for name, (drafted, accepted) in drafts.items():
            seen_drafted, seen_accepted = self._drafts.get(name, (0, 0))
            if drafted < seen_drafted:  # unloaded and loaded again between scrapes: counted from zero
                seen_drafted = seen_accepted = 0
            self.draft_tokens.labels(m, name).inc(drafted - seen_drafted)
            self.accepted_tokens.labels(m, name).inc(accepted - seen_accepted)
            self._drafts[name] = (drafted, accepted)
