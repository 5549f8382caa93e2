"""A real Prometheus server scrapes the engine; the tuner's PromQL returns numbers after some load."""

from __future__ import annotations

import math
import pkgutil
import re
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

DESIGN_METRICS = [
    "specfleet_time_to_first_token_seconds",
    "specfleet_time_per_output_token_seconds",
    "specfleet_inter_token_latency_seconds",
    "specfleet_e2e_request_latency_seconds",
    "specfleet_request_queue_time_seconds",
    "specfleet_step_duration_seconds",
    "specfleet_batch_size",
    "specfleet_num_requests_running",
    "specfleet_num_requests_waiting",
    "specfleet_kv_cache_usage_ratio",
    "specfleet_num_speculative_tokens",
    "specfleet_max_num_seqs",
    "specfleet_max_num_batched_tokens",
    "specfleet_prompt_tokens_total",
    "specfleet_generation_tokens_total",
    "specfleet_request_success_total",
    "specfleet_num_preemptions_total",
    "specfleet_prefix_cache_queries_total",
    "specfleet_prefix_cache_hits_total",
    "specfleet_spec_decode_drafts_total",
    "specfleet_spec_decode_draft_tokens_total",
    "specfleet_spec_decode_accepted_tokens_total",
]
ACCEPTANCE = (
    "sum(rate(specfleet_spec_decode_accepted_tokens_total[1m])) / "
    "sum(rate(specfleet_spec_decode_draft_tokens_total[1m]))"
)
TTFT_P95 = "histogram_quantile(0.95, sum by (le) (rate(specfleet_time_to_first_token_seconds_bucket[1m])))"


def _has_spec_decode() -> bool:
    import specfleet.engine.spec_decode as spec_decode

    return any(pkgutil.iter_modules(spec_decode.__path__))


@pytest.fixture(scope="module")
def prometheus(server: Any, prometheus_factory) -> str:
    return prometheus_factory("specfleet-test", [server.url])


def query(prom: str, promql: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{prom}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert resp["status"] == "success", resp
    return resp["data"]["result"]


def wait_for_value(prom: str, promql: str, ok: Any, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    value = math.nan
    while time.monotonic() < deadline:
        result = query(prom, promql)
        if result:
            value = float(result[0]["value"][1])
            if ok(value):
                return value
        time.sleep(0.5)
    raise AssertionError(f"{promql} -> {value} after {timeout}s")


def test_metrics_endpoint_has_every_design_name(server: Any) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    names = set(re.findall(r"^([a-z0-9_]+)\{", text, re.MULTILINE))
    names |= {n for n in re.findall(r"^([a-z0-9_]+)_bucket\{", text, re.MULTILINE)}
    missing = [n for n in DESIGN_METRICS if n not in names]
    assert not missing, missing
    assert 'model_name="' in text
    assert re.search(r'^specfleet_request_success_total\{[^}]*finished_reason="stop"', text, re.MULTILINE)


def test_promql_acceptance_rate_and_ttft_p95(
    prometheus: str, server: Any, client: Any, model_name: str
) -> None:
    wait_for_value(prometheus, 'up{job="specfleet-test"}', lambda v: v == 1.0)
    time.sleep(1.5)  # a scrape before the load, so rate() sees the increase
    repetitive = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"  # n-gram drafts hit here
    for prompt in (repetitive, "The quick brown fox jumps over", repetitive):
        client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    ttft_p95 = wait_for_value(prometheus, TTFT_P95, lambda v: math.isfinite(v) and v > 0)
    assert 0 < ttft_p95 < 80
    stats = server.async_engine.call_sync("stats")["num_draft_tokens"]
    if stats == 0 and not _has_spec_decode():
        pytest.skip(
            "speculative decoding is not in the engine yet (specfleet.engine.spec_decode is empty): "
            "TTFT p95 checked, the acceptance rate has no draft tokens to divide"
        )
    if stats == 0:
        pytest.fail(
            "the engine reported no speculative draft tokens with speculative_method='ngram', k=2: "
            "the acceptance-rate PromQL has nothing to divide"
        )
    rate = wait_for_value(prometheus, ACCEPTANCE, lambda v: math.isfinite(v))
    assert 0.0 <= rate <= 1.0
    assert query(prometheus, 'specfleet_num_speculative_tokens{model_name!=""}')


def test_finished_requests_reach_their_class_of_acceptance(server: Any, client: Any, model_name: str) -> None:
    """Through the engine core's stats and the server's /metrics (engine/spec_decode/request_classes.py):
    each finished request that decoded is counted in one class, read back as bench sim reads it."""
    from specfleet.sim.acceptance import classes_from_metrics

    def counted() -> float:
        return sum(c.requests for c in classes_from_metrics([httpx.get(f"{server.url}/metrics").text], 2))

    before = counted()
    repetitive = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"  # n-gram drafts hit here
    for prompt in (repetitive, "The quick brown fox jumps over"):
        client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    deadline = time.monotonic() + 10
    while counted() < before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counted() == before + 2
    text = httpx.get(f"{server.url}/metrics").text
    assert re.search(r'^specfleet_spec_decode_class_requests_total\{[^}]*class="', text, re.MULTILINE)


def test_the_core_loops_gap_between_back_to_back_steps_is_exported(
    server: Any, client: Any, model_name: str
) -> None:
    """`specfleet_step_gap_seconds_total` (engine/core/proc.py): the core's seconds between back-to-back
    steps, outside them, as bench sim prices them per step; it grows with decoding and stays a small share
    of the steps' own seconds on an engine that has its host to itself."""
    from specfleet.tuner.snapshot import parse_metrics

    def read() -> tuple[float, float, float]:
        snap = parse_metrics(httpx.get(f"{server.url}/metrics").text, 0.0)
        steps = snap.counts.get("step_duration_seconds", 0.0)
        return snap.counters.get("step_gap_seconds", 0.0), snap.sums.get("step_duration_seconds", 0.0), steps

    gap0, seconds0, steps0 = read()
    client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=24, temperature=0)
    gap1, seconds1, steps1 = read()
    steps = steps1 - steps0
    assert steps >= 20  # a prefill step, then one decode step per token: back to back
    gap = gap1 - gap0
    # between two steps the core builds and sends a report and drains its inputs: tens of microseconds on an
    # idle core; a loop that counted nothing (or idle time as gap) fails one side
    assert 0.0 < gap / steps < 0.5 * (seconds1 - seconds0) / steps
