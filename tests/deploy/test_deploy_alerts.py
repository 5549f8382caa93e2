"""The Prometheus rules pass `promtool check rules` and their unit tests (`promtool test rules`), every alert
is tested firing and not firing, links a runbook section that exists, and reads only series that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from specfleet.engine.server.metrics import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS
from specfleet.operator.spec import SLOSpec

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "monitoring" / "prometheus-rules.yaml"
RULE_TESTS = Path(__file__).with_name("prometheus-rules.test.yaml")
CRS = REPO / "deploy" / "monitoring" / "kube-state-metrics-crs.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"
CRD = REPO / "crds" / "inferenceservice.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing: apt-get install -y prometheus "
                                    "(.ci/setup installs it)")


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


@needs_promtool
def test_promtool_check_rules() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_catch_a_changed_threshold(tmp_path: Path) -> None:
    """The unit tests can fail: the fast-burn factor lowered from 14.4 to 6 makes them fail."""
    (tmp_path / "deploy" / "monitoring").mkdir(parents=True)
    (tmp_path / "tests" / "deploy").mkdir(parents=True)
    (tmp_path / "deploy" / "monitoring" / RULES.name).write_text(RULES.read_text().replace("(14.4 * 0.05)", "(6 * 0.05)"))
    (tmp_path / "tests" / "deploy" / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests" / "deploy" / RULE_TESTS.name)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "SpecfleetTTFTBudgetBurnFast" in result.stdout + result.stderr


def _services(series: list[dict[str, Any]]) -> set[str]:
    return {m.group(1) for s in series for m in [re.search(r'service="([^"]+)"', s["series"])] if m} | {
        m.group(1) for s in series for m in [re.search(r'deployment="([^"]+)"', s["series"])] if m} | {
        m.group(1) for s in series for m in [re.search(r'pod="([^"]+)"', s["series"])] if m}


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        present = _services(group["input_series"])
        for case in group.get("alert_rule_test", []):
            expected = case.get("exp_alerts") or []
            if expected:
                firing.add(case["alertname"])
            shown = {v for a in expected for k, v in a["exp_labels"].items() if k in ("service", "deployment", "pod")}
            if not expected or present - shown:
                quiet.add(case["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested not firing"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


def test_every_alert_links_an_existing_runbook_section() -> None:
    anchors = _anchors(RUNBOOKS.read_text())
    for alert in alerts():
        url = alert["annotations"]["runbook_url"]
        assert url.startswith("https://github.com/specfleet/specfleet/blob/main/docs/runbooks.md#"), url
        assert url.split("#", 1)[1] in anchors, f"{alert['alert']}: no section {url} in docs/runbooks.md"
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]


def test_slo_thresholds_are_the_crd_defaults_and_bucket_bounds() -> None:
    text = RULES.read_text()
    for metric, default_ms, buckets in [
        ("specfleet_time_to_first_token_seconds", SLOSpec().ttft_p95_ms, LATENCY_BUCKETS),
        ("specfleet_time_per_output_token_seconds", SLOSpec().tpot_p95_ms, TOKEN_LATENCY_BUCKETS),
    ]:
        bounds = set(re.findall(re.escape(metric) + r'_bucket\{le="([^"]+)"\}', text))
        assert bounds == {repr(default_ms / 1000)}, (metric, bounds)
        assert default_ms / 1000 in buckets, f"{default_ms} ms is not a bucket bound of {metric}"


def test_inferenceservice_series_come_from_the_kube_state_metrics_config() -> None:
    config = yaml.safe_load(CRS.read_text())["spec"]["resources"]
    (resource,) = config
    prefix = resource["metricNamePrefix"]
    declared = {f"{prefix}_{m['name']}" for m in resource["metrics"]}
    used = set(re.findall(prefix + r"_\w+", RULES.read_text()))
    assert used and used <= declared, used - declared
    assert set(resource["labelsFromPath"]) == {"namespace", "service"}
    # every path the config reads exists in the CRD's schema
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for metric in resource["metrics"]:
        node = schema
        for key in metric["each"]["gauge"]["path"]:
            node = node["items"] if node.get("type") == "array" else node
            assert key in node.get("properties", {}) or (key in ("generation", "namespace", "name")
                                                          and node.get("type") == "object"), (metric["name"], key)
            node = node.get("properties", {}).get(key, {})
        node = node.get("items", node)
        for key in [*metric["each"]["gauge"].get("labelsFromPath", {}).values(),
                    metric["each"]["gauge"].get("valueFrom", [])]:
            if key:
                assert key[0] in node.get("properties", {}), (metric["name"], key)


def test_engine_series_in_the_rules_exist() -> None:
    """Every specfleet_ engine series an alert or recording rule reads is one the engine exports."""
    from prometheus_client import CollectorRegistry
    from specfleet.engine.server.metrics import ServerMetrics

    registry = CollectorRegistry()
    ServerMetrics("m", registry)
    exported = {s.name for family in registry.collect() for s in family.samples}
    used = set(re.findall(r"(?<![\w:])(specfleet_(?!inferenceservice_)\w+)", RULES.read_text()))
    assert used and used <= exported, used - exported
