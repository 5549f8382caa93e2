"""The engine's /metrics against the Gateway API Inference Extension's model-server protocol document
(tests/fixtures/gie/model_server_protocol.md): every vLLM metric its tables name, with the type and labels
it specifies, parsed with prometheus_client's own parser, and the values move with the load."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

DOC = Path(__file__).parent.parent / "fixtures" / "gie" / "model_server_protocol.md"


def protocol_rows() -> list[tuple[str, str, str | None]]:
    """(metric, type, label or None) for each vLLM metric the document's metrics table names."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[1] not in ("Gauge", "Labeled/Gauge"):
            continue
        vllm = cells[3]
        labeled = re.fullmatch(r"name: `([^`]+)`, label name: `([^`]+)`", vllm)
        if labeled:
            rows.append((labeled[1], "gauge", labeled[2]))
        else:
            rows.append((vllm.strip("`"), "gauge", None))
    return rows


def scrape(url: str) -> dict[str, Any]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_document_names_what_this_test_checks() -> None:
    names = {name for name, _, _ in protocol_rows()}
    assert {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    } <= names
    assert "`vllm:lora_requests_info`" in DOC.read_text()  # served with --enable-lora (test_lora_http.py)


def test_every_protocol_metric_is_served_with_its_type_and_labels(server: Any) -> None:
    families = scrape(server.url)
    for name, kind, label in protocol_rows():
        assert name in families, f"{name} missing from /metrics"
        family = families[name]
        assert family.type == kind, (name, family.type)
        assert family.samples, f"{name} has no sample"
        if label is not None:
            values = [s.labels[label] for s in family.samples]
            assert all(v.isdigit() and int(v) > 0 for v in values), (name, label, values)
    # the document's numbers are the engine's own
    (config,) = families["vllm:cache_config_info"].samples
    assert int(config.labels["block_size"]) == server.async_engine.config.block_size
    assert int(config.labels["num_gpu_blocks"]) == server.async_engine.info.num_kv_blocks
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        (sample,) = families[name].samples
        assert 0.0 <= sample.value <= 1.0, (name, sample.value)
        assert sample.labels["model_name"] == server.state.model_name


def test_waiting_and_running_follow_the_load(server: Any, model_name: str) -> None:
    """With max_num_seqs=2 and 8 concurrent requests, 2 run and the rest wait; after, both read 0."""
    start = server.async_engine.live.max_num_seqs
    server.async_engine.call_sync("update_config", max_num_seqs=2)
    body = {"model": model_name, "prompt": "Count slowly: one, two,", "max_tokens": 48, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=httpx.post, args=(f"{server.url}/v1/completions",), kwargs={"json": body, "timeout": 300}
        )
        for _ in range(8)
    ]
    peak = {
        "vllm:num_requests_waiting": 0.0,
        "vllm:num_requests_running": 0.0,
        "vllm:kv_cache_usage_perc": 0.0,
    }
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 240
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            families = scrape(server.url)
            for name in peak:
                peak[name] = max(peak[name], families[name].samples[0].value)
            time.sleep(0.2)
        for t in threads:
            t.join(60)
    finally:
        server.async_engine.call_sync("update_config", max_num_seqs=start)
    assert peak["vllm:num_requests_waiting"] >= 1, peak
    assert 1 <= peak["vllm:num_requests_running"] <= 2, peak
    assert peak["vllm:kv_cache_usage_perc"] > 0, peak
    server.wait_idle()

    def idle() -> bool:
        families = scrape(server.url)
        return all(
            families[name].samples[0].value == 0
            for name in ("vllm:num_requests_waiting", "vllm:num_requests_running")
        )

    # the idle core reports every HEARTBEAT_S (1 s): at its next report, which a loaded host may hold back
    # past a fixed sleep
    wait_for("the gauges back at 0 once idle", idle, timeout=30)
