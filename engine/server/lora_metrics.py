"""LoRA metrics: vLLM's `vllm:lora_requests_info` gauge, and specfleet's adapter loads, evictions and load
time. Read from the engine core (`lora_state`) when /metrics is scraped, into the server's registry.

vLLM encodes adapter activity in labels: one sample whose labels are `max_lora`, `running_lora_adapters`
and `waiting_lora_adapters` (comma-joined names of adapters with requests in flight) and whose value is
the wall-clock time it was taken; a reader takes the latest sample (the GIE endpoint picker does).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self._loads = self._evictions = 0

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
