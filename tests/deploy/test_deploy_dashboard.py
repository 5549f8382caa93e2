"""The Grafana dashboard against real data: two engine processes under load, a real Prometheus scraping them
with the labels the operator's ServiceMonitor adds behind the router (namespace, service `chat-engines`, job
`chat`: the InferenceService, pod) and evaluating prometheus-rules.yaml; every
panel query, every template variable and the tuner-decision annotation return data through Prometheus'
HTTP API. A dashboard whose queries silently return nothing is what this catches."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import free_port, start_server, stop_process, wait_http_ready
from tuner.conftest import ADMIN_TOKEN, ENGINE_ARGS

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "monitoring" / "grafana-dashboard.json"
RULES = REPO / "deploy" / "monitoring" / "prometheus-rules.yaml"
# as the Prometheus Operator labels the targets of the operator's ServiceMonitor behind the router (the default):
# `service` is the engines' headless Service, `job` the InferenceService (the ServiceMonitor's jobLabel)
LABELS = {"namespace": "demo", "service": "chat-engines", "job": "chat"}
# Template variables -> what Grafana sends with "All" selected (regex-all), and a rate window that holds a
# few of the 1 s scrapes.
SUBSTITUTIONS = {
    "$namespace": ".*",
    "$service": ".*",
    "$pod": ".*",
    "$__rate_interval": "15s",
    "$__interval": "5s",
    "${datasource}": "prometheus",
}
# Seconds of load (the retune halfway): longer than the panels' 15 s rate windows of 1 s scrapes.
LOAD_S = 20
GROUNDED = (
    "Copy this list exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
    "Copy: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def panel_queries() -> list[tuple[str, str]]:
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def test_dashboard_has_grafanas_required_structure() -> None:
    dash = dashboard()
    assert {"title", "uid", "schemaVersion", "panels", "templating", "annotations", "time"} <= set(dash)
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        assert {"type", "title", "gridPos", "datasource", "targets"} <= set(panel), panel.get("title")
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"] for t in panel["targets"]), panel[
            "title"
        ]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "service", "pod"} <= set(variables)
    for name in ("namespace", "service", "pod"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    # "InferenceService" lists the `job` label, the InferenceService's name in every mode; the `service`
    # label is the Service scraped (NAME-engines behind the router, NAME-prefill/-decode disaggregated)
    assert variables["service"]["query"]["query"].endswith(", job)"), variables["service"]
    assert all('job=~"$service"' in e and "service=~" not in e for _, e in panel_queries()), "select by job"
    for _, expr in panel_queries():
        if "namespace_service:" not in expr:  # recording rules are per service already
            for var in ("$namespace", "$service", "$pod"):
                assert var in expr, f"{expr} ignores {var}"


def test_dashboard_shows_what_the_issue_lists() -> None:
    exprs = " ".join(expr for _, expr in panel_queries())
    for metric in (
        "generation_tokens_total",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_success_total",
        "num_requests_waiting",
        "kv_cache_usage_ratio",
        "num_preemptions_total",
        "spec_decode_accepted_tokens_total",
        "spec_decode_accepted_tokens_per_pos_total",
        "num_speculative_tokens",
        "max_num_seqs",
        "max_num_batched_tokens",
    ):
        assert f"specfleet_{metric}" in exprs, metric
    names = [a["name"] for a in dashboard()["annotations"]["list"]]
    assert "Tuner decisions" in names


def _start_engine(tmp: Path, index: int) -> tuple[str, subprocess.Popen[bytes]]:
    log = tmp / f"engine-{index}.log"
    env = {"SPECFLEET_ADMIN_TOKEN": ADMIN_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    # k=2: the acceptance panels need verified drafts
    proc, url = start_server(log, *ENGINE_ARGS, "--num-speculative-tokens", "2", env=env)
    return url, proc


def _start_prometheus(tmp: Path, engines: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is missing: apt-get install -y prometheus (.ci/setup installs it)")
    # One static target per pod, labelled as the Prometheus Operator labels a ServiceMonitor's targets.
    targets = "".join(
        f"      - targets: ['{url.removeprefix('http://')}']\n"
        f"        labels: {{namespace: {LABELS['namespace']}, service: {LABELS['service']}, job: {LABELS['job']},"
        f" pod: chat-{i}}}\n"
        for i, url in enumerate(engines)
    )
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"
        f"scrape_configs:\n  - job_name: specfleet\n    static_configs:\n{targets}"
    )
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(f"{url}/-/ready", proc, tmp / "prometheus.log", timeout=60, interval=0.2)
    return url, proc


# When `_load`'s retune patched the engines: the annotation test's window is placed around it, not around
# the time that test runs (earlier tests in the module take longer on a loaded machine).
RETUNED_AT: list[float] = []


async def _load(engines: list[str], seconds: float) -> None:
    """Two workers per engine, streamed and plain completions on an input-grounded prompt (drafts accepted);
    halfway through, a tuner-style PATCH of the live config, which the annotation must show."""
    stop = time.monotonic() + seconds

    async def worker(url: str, w: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            i = 0
            while time.monotonic() < stop:
                body = {
                    "model": "smollm2-135m-instruct",
                    "prompt": f"{GROUNDED} {w} {i}",
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": i % 2 == 0,
                }
                async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    assert resp.status_code == 200, await resp.aread()
                    async for _ in resp.aiter_bytes():
                        pass
                i += 1

    async def retune() -> None:
        await asyncio.sleep(seconds / 2)
        async with httpx.AsyncClient(
            timeout=10, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as client:
            for url in engines:
                resp = await client.patch(
                    f"{url}/admin/config", json={"num_speculative_tokens": 3, "max_num_seqs": 12}
                )
                assert resp.status_code == 200, resp.text
        RETUNED_AT.append(time.time())

    await asyncio.gather(retune(), *(worker(url, w) for url in engines for w in range(2)))


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("dashboard")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # both engines start side by side (start-up is mostly import and model load, one core each)
        with ThreadPoolExecutor(max_workers=2) as pool:
            starting = [pool.submit(_start_engine, tmp, i) for i in range(2)]
            started = [f.result() for f in starting if f.exception() is None]
        procs.extend(proc for _, proc in started)
        for f in starting:
            error = f.exception()
            if error is not None:
                raise error
        engines = [url for url, _ in started]
        prom, proc = _start_prometheus(tmp, engines)
        procs.append(proc)
        asyncio.run(_load(engines, seconds=LOAD_S))
        time.sleep(3)  # a last scrape and rule evaluation after the load
        yield prom
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def instant(prom: str, expr: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert resp["status"] == "success", f"{expr}: {resp}"
    return resp["data"]["result"]


def range_query(prom: str, expr: str, seconds: float) -> list[dict[str, Any]]:
    now = time.time()
    resp = httpx.get(
        f"{prom}/api/v1/query_range",
        params={"query": expr, "start": now - seconds, "end": now, "step": "1s"},
        timeout=10,
    ).json()
    assert resp["status"] == "success", f"{expr}: {resp}"
    return resp["data"]["result"]


def _finite(result: list[dict[str, Any]]) -> bool:
    values = [
        float(v)
        for series in result
        for _, v in ([series["value"]] if "value" in series else series["values"])
    ]
    return any(math.isfinite(v) for v in values)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_panel_query_returns_data(prometheus: str) -> None:
    empty = []
    for name, expr in panel_queries():
        # over the load window, as a panel draws it: a finite value somewhere, not only NaN or nothing
        if not _finite(range_query(prometheus, substitute(expr), seconds=40)):
            empty.append(f"{name}: {substitute(expr)}")
    assert empty == [], "panels without data:\n" + "\n".join(empty)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_template_variables_resolve_to_the_scraped_labels(prometheus: str) -> None:
    expected = {
        "namespace": {"demo"},
        "job": {"chat"},
        "pod": {"chat-0", "chat-1"},
    }  # job: the InferenceService
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector, label = substitute(match.group(1)), match.group(2)
        resp = httpx.get(
            f"{prometheus}/api/v1/label/{label}/values", params={"match[]": selector}, timeout=10
        ).json()
        assert set(resp["data"]) == expected[label], (variable["name"], resp)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tuner_decisions_show_as_annotations(prometheus: str) -> None:
    (annotation,) = [a for a in dashboard()["annotations"]["list"] if a["name"] == "Tuner decisions"]
    (retuned,) = RETUNED_AT
    start = retuned - 15  # the first half of the load, before the change
    result = range_query(prometheus, substitute(annotation["expr"]), seconds=time.time() - start)
    assert {s["metric"]["pod"] for s in result} == {"chat-0", "chat-1"}, result
    # only from the change on (halfway through the load), not over the whole window
    first = min(float(t) for s in result for t, _ in s["values"])
    assert first > start + 10, (first - start, result)


def test_panels_mixing_units_give_each_series_its_own() -> None:
    """A panel whose series have different units (batch size, step seconds) overrides the seconds series'
    unit, so a 50 ms step does not read as 0.05 sequences on the batch axis."""
    for panel in dashboard()["panels"]:
        legends = [t.get("legendFormat", "") for t in panel["targets"]]
        default = panel["fieldConfig"]["defaults"].get("unit")
        seconds = [legend for legend in legends if legend.endswith("(s)")]
        if default == "s" or not seconds:
            continue
        overridden = {
            o["matcher"]["options"]
            for o in panel["fieldConfig"]["overrides"]
            if {"id": "unit", "value": "s"} in o["properties"]
        }
        assert set(seconds) <= overridden, panel["title"]
