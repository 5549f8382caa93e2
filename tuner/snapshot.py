"""One scrape of one engine's /metrics, and the observation two successive scrapes of a fleet make.

The direct-scrape source's arithmetic: counter and histogram deltas over the time between scrapes, summed
over pods, exactly what PromQL's `sum(rate(x[w]))` and `sum by (le) (rate(x_bucket[w]))` compute.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families
from specfleet.engine.knobs import METRIC_PREFIX, SEARCHED

from .histogram import quantile, subtract, to_cdf
from .types import AdapterRequests, Observation, TunedConfig

P = METRIC_PREFIX
COUNTERS = (
    "generation_tokens",
    "prompt_tokens",
    "spec_decode_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_shadow_lookups",
    "spec_decode_shadow_drafts",
)
# per draft position (label `position`): verified drafts' accepted tokens, and shadow drafts' (the engine's
# n-gram lookups scored while it verifies none, engine/spec_decode/shadow.py)
PER_POSITION = ("spec_decode_accepted_tokens_per_pos", "spec_decode_shadow_accepted_tokens_per_pos")
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "step_duration_seconds",
    "batch_size",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)
# the steps that computed no prompt token, apart (engine/server/metrics.py): parsed for bench sim's calibration
# of decode and prefill steps each, not observed by the tuner (its queries stay as they were)
DECODE_STEP_COUNTERS = ("decode_step_sequences", "decode_step_draft_tokens", "decode_step_drafts")
DECODE_STEP_HISTOGRAM = "decode_step_duration_seconds"
# the core loop's seconds between back-to-back steps (engine/stats.py `step_gap_s`): bench sim's too
STEP_GAP_COUNTER = "step_gap_seconds"
_PARSED_COUNTERS = (*COUNTERS, *DECODE_STEP_COUNTERS, STEP_GAP_COUNTER)
_PARSED_HISTOGRAMS = (*HISTOGRAMS, DECODE_STEP_HISTOGRAM)
# the load gauges, then the config gauge of every searched knob (the config in force)
CONFIG_GAUGES = tuple(knob.gauge[len(P) :] for knob in SEARCHED)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", *CONFIG_GAUGES)


# vLLM's LoRA gauge (labels max_lora, running_lora_adapters, waiting_lora_adapters), read into two gauges
LORA_INFO, LORA_SLOTS, LORA_ADAPTERS = "vllm:lora_requests_info", "lora:slots", "lora:adapters"


PerPosition = dict[str, dict[int, float]]  # family (PER_POSITION) -> draft position -> value
# per LoRA adapter (label `lora_name`, engine/server/lora_metrics.py): draft tokens, then accepted ones
LORA_DRAFTS = ("lora_spec_decode_draft_tokens", "lora_spec_decode_accepted_tokens")
# per LoRA adapter: its finished requests' output tokens, and their TTFT and TPOT histograms (goodput's inputs)
LORA_TOKENS = "lora_generation_tokens"
LORA_LATENCY = ("lora_time_to_first_token_seconds", "lora_time_per_output_token_seconds")
PerAdapterBuckets = dict[str, dict[str, list[tuple[float, float]]]]  # histogram -> adapter -> (le, count)


@dataclass
class Snapshot:
    time: float
    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    requests: float = 0.0  # finished requests, every reason
    per_pos: PerPosition = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    buckets: dict[str, dict[float, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    gauges: dict[str, float] = field(default_factory=dict)
    lora_drafts: dict[str, list[float]] = field(default_factory=dict)  # adapter -> [drafted, accepted]
    lora_tokens: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # adapter -> tokens
    # LORA_LATENCY histogram -> adapter -> le -> cumulative count
    lora_buckets: dict[str, dict[str, dict[float, float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    )

    def config(self) -> TunedConfig | None:
        try:
            return TunedConfig(**{knob.name: int(self.gauges[knob.gauge]) for knob in SEARCHED})
        except KeyError:
            return None


def parse_metrics(text: str, time: float) -> Snapshot:
    """Parse Prometheus text format (every model_name summed) into a snapshot."""
    snap = Snapshot(time)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == LORA_INFO:  # one sample, refreshed each scrape (engine/server/lora_metrics.py)
                snap.gauges.update(lora_info_gauges(labels))
            if not name.startswith(P):
                continue
            short = name[len(P) :]
            if short.endswith("_total") and short[:-6] in _PARSED_COUNTERS:
                snap.counters[short[:-6]] += value
            elif short.endswith("_total") and short[:-6] in LORA_DRAFTS:
                counts = snap.lora_drafts.setdefault(labels.get("lora_name", ""), [0.0, 0.0])
                counts[LORA_DRAFTS.index(short[:-6])] += value
            elif short == LORA_TOKENS + "_total":
                snap.lora_tokens[labels.get("lora_name", "")] += value
            elif short.endswith("_bucket") and short[:-7] in LORA_LATENCY:
                snap.lora_buckets[short[:-7]][labels.get("lora_name", "")][float(labels["le"])] += value
            elif short == "request_success_total":
                snap.requests += value
            elif short.endswith("_total") and short[:-6] in PER_POSITION:
                snap.per_pos[short[:-6]][int(labels.get("position", "0"))] += value
            elif short.endswith("_bucket") and short[:-7] in _PARSED_HISTOGRAMS:
                snap.buckets[short[:-7]][float(labels["le"])] += value
            elif short.endswith("_sum") and short[:-4] in _PARSED_HISTOGRAMS:
                snap.sums[short[:-4]] += value
            elif short.endswith("_count") and short[:-6] in _PARSED_HISTOGRAMS:
                snap.counts[short[:-6]] += value
            elif short in GAUGES:
                snap.gauges[name] = snap.gauges.get(name, 0.0) + value
    return snap


def lora_info_gauges(labels: dict[str, str]) -> dict[str, float]:
    """One engine's vllm:lora_requests_info sample, by its labels: its adapter slots (--max-loras) and the
    adapters with requests running or waiting on it."""
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    return {
        LORA_ADAPTERS: float(len({n for n in names.split(",") if n})),
        LORA_SLOTS: float(labels.get("max_lora") or 0),
    }


def _delta(after: float, before: float) -> float:
    return after - before if after >= before else after  # a restarted pod's counters start over


@dataclass
class _Sums:
    rates: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    per_pos: PerPosition = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    buckets: dict[str, dict[float, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def observe_pairs(pairs: Sequence[tuple[Snapshot, Snapshot]], now: float) -> Observation:
    """The observation of a fleet from (previous, current) snapshot pairs, one pair per pod."""
    if not pairs:
        return Observation(time=now, config=None, error="no engine answered its /metrics scrape")
    acc = _Sums()
    configs = set()
    running = waiting = 0.0
    kv = 0.0
    for before, after in pairs:
        dt = max(after.time - before.time, 1e-6)
        for name in COUNTERS:
            acc.rates[name] += _delta(after.counters.get(name, 0.0), before.counters.get(name, 0.0)) / dt
        acc.rates["requests"] += _delta(after.requests, before.requests) / dt
        for family in PER_POSITION:
            for pos, value in after.per_pos[family].items():
                acc.per_pos[family][pos] += _delta(value, before.per_pos[family].get(pos, 0.0)) / dt
        for hist in HISTOGRAMS:
            delta = subtract(sorted(after.buckets[hist].items()), sorted(before.buckets[hist].items()))
            for le, count in delta:
                acc.buckets[hist][le] += count
            acc.sums[hist] += _delta(after.sums[hist], before.sums[hist]) / dt
            acc.counts[hist] += _delta(after.counts[hist], before.counts[hist]) / dt
        configs.add(after.config())
        running += after.gauges.get(P + "num_requests_running", 0.0)
        waiting += after.gauges.get(P + "num_requests_waiting", 0.0)
        kv = max(kv, after.gauges.get(P + "kv_cache_usage_ratio", 0.0))
    lora = [a.gauges for _, a in pairs if LORA_SLOTS in a.gauges]
    obs = build_observation(
        now,
        acc.rates,
        acc.per_pos,
        {h: list(b.items()) for h, b in acc.buckets.items()},
        acc.sums,
        acc.counts,
        running,
        waiting,
        kv,
        configs.pop() if len(configs) == 1 else None,
        len(pairs),
    )
    acceptance = _lora_acceptance(pairs)
    if acceptance:
        obs = replace(obs, lora_acceptance=acceptance)
    requests = _lora_requests(pairs)
    if requests:
        obs = replace(obs, lora_requests=requests)
    if not lora:
        return obs
    return replace(
        obs,
        lora_slots=sum(g[LORA_SLOTS] for g in lora) / len(lora),
        lora_adapters=sum(g[LORA_ADAPTERS] for g in lora) / len(lora),
    )


def _lora_acceptance(pairs: Sequence[tuple[Snapshot, Snapshot]]) -> tuple[tuple[str, float], ...]:
    """Each adapter's accepted / drafted tokens over the window, pods summed; adapters without drafts left out."""
    drafted: dict[str, float] = defaultdict(float)
    accepted: dict[str, float] = defaultdict(float)
    for before, after in pairs:
        for name, (d, a) in after.lora_drafts.items():
            d0, a0 = before.lora_drafts.get(name, (0.0, 0.0))
            if d < d0:  # the pod restarted or the adapter was loaded again: its counters started over
                d0 = a0 = 0.0
            drafted[name] += d - d0
            accepted[name] += a - a0
    return acceptance_by_adapter(drafted, accepted)


def _lora_requests(pairs: Sequence[tuple[Snapshot, Snapshot]]) -> tuple[AdapterRequests, ...]:
    """Each adapter's finished requests over the window: token rates and histogram deltas, pods summed."""
    tokens: dict[str, float] = defaultdict(float)
    buckets: PerAdapterBuckets = {h: defaultdict(list) for h in LORA_LATENCY}
    for before, after in pairs:
        dt = max(after.time - before.time, 1e-6)
        for name, value in after.lora_tokens.items():
            tokens[name] += _delta(value, before.lora_tokens.get(name, 0.0)) / dt
        for hist in LORA_LATENCY:
            for name, counts in after.lora_buckets[hist].items():
                delta = subtract(sorted(counts.items()), sorted(before.lora_buckets[hist][name].items()))
                buckets[hist][name] = _add(buckets[hist][name], delta)
    return adapter_requests(tokens, buckets)


def _add(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    total = defaultdict(float, a)
    for le, count in b:
        total[le] += count
    return sorted(total.items())


def adapter_requests(tokens: dict[str, float], buckets: PerAdapterBuckets) -> tuple[AdapterRequests, ...]:
    """Both sources' per-adapter request figures: output tokens/s and the TTFT and TPOT bucket counts (or
    rates) of each adapter; adapters that finished no request in the window are left out."""
    ttft, tpot = (buckets.get(h, {}) for h in LORA_LATENCY)
    seen = []
    for name in sorted(set(tokens) | set(ttft) | set(tpot)):
        ttft_cdf, tpot_cdf = to_cdf(ttft.get(name, [])), to_cdf(tpot.get(name, []))
        if ttft_cdf or tpot_cdf:
            seen.append(AdapterRequests(name, tokens.get(name, 0.0), ttft_cdf, tpot_cdf))
    return tuple(seen)


def acceptance_by_adapter(
    drafted: dict[str, float], accepted: dict[str, float]
) -> tuple[tuple[str, float], ...]:
    """Both sources' per-adapter acceptance: accepted / drafted tokens (or their rates), sorted by name;
    adapters without drafts left out."""
    return tuple(
        (name, accepted.get(name, 0.0) / drafted[name]) for name in sorted(drafted) if drafted[name] > 0
    )


def build_observation(
    now: float,
    rates: dict[str, float],
    per_pos: PerPosition,
    buckets: dict[str, list[tuple[float, float]]],
    sums: dict[str, float],
    count_rates: dict[str, float],
    running: float,
    waiting: float,
    kv: float,
    config: TunedConfig | None,
    pods: int,
) -> Observation:
    """Shared by both sources: rates per second, bucket counts or rates (any scale), and the histograms'
    `_sum` and `_count` rates per second (their ratio is the mean)."""

    def mean(hist: str) -> float | None:
        count = count_rates.get(hist, 0.0)
        return sums.get(hist, 0.0) / count if count > 0 else None

    steps = count_rates.get("step_duration_seconds") or None
    in_system_now = running + waiting  # the gauges, at the window's end
    # Little's law: the rate of the latency sums is the mean number of requests in the system (waiting)
    # over the window, steadier than the gauges' value at one instant.
    if count_rates.get("e2e_request_latency_seconds", 0.0) > 0:
        in_system = sums.get("e2e_request_latency_seconds", 0.0)
        waiting = min(in_system, sums.get("request_queue_time_seconds", 0.0))
        running = max(0.0, in_system - waiting)
    drafts = rates.get("spec_decode_drafts", 0.0)
    verified = per_pos.get(PER_POSITION[0], {})
    # Positions past the k in force were not drafted in this window (their counters only linger from an
    # earlier, larger k): leave them out rather than report them as never accepted.
    drafted = max(verified, default=-1) + 1 if config is None else config.num_speculative_tokens
    positions = [verified.get(i, 0.0) / drafts for i in range(drafted)] if drafts > 0 else []
    shadow_drafts = rates.get("spec_decode_shadow_drafts", 0.0)
    shadow = per_pos.get(PER_POSITION[1], {})
    shadow_positions = (
        [shadow.get(i, 0.0) / shadow_drafts for i in range(max(shadow, default=-1) + 1)]
        if shadow_drafts > 0
        else []
    )
    tpot, ttft = (
        buckets.get("time_per_output_token_seconds", []),
        buckets.get("time_to_first_token_seconds", []),
    )
    return Observation(
        time=now,
        config=config,
        pods=pods,
        request_rate=rates.get("requests", 0.0),
        generation_rate=rates.get("generation_tokens", 0.0),
        prompt_rate=rates.get("prompt_tokens", 0.0),
        running=running,
        waiting=waiting,
        in_system_now=in_system_now,
        kv_usage=kv,
        ttft_p95_s=quantile(0.95, ttft),
        tpot_p95_s=quantile(0.95, tpot),
        ttft_cdf=to_cdf(ttft),
        tpot_cdf=to_cdf(tpot),
        step_rate=steps,
        step_duration_s=mean("step_duration_seconds"),
        batch_size=mean("batch_size"),
        draft_rate=drafts,
        draft_token_rate=rates.get("spec_decode_draft_tokens", 0.0),
        accepted_rate=rates.get("spec_decode_accepted_tokens", 0.0),
        accepted_per_pos=tuple(positions),
        shadow_lookup_rate=rates.get("spec_decode_shadow_lookups", 0.0),
        shadow_draft_rate=shadow_drafts,
        shadow_accepted_per_pos=tuple(shadow_positions),
    )
