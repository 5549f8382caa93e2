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
RUNBOOKS = REPO / "docs" / "runbooks.md"
CRD = REPO / "crds" / "inferenceservice.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing: apt-get install -y prometheus (.ci/setup installs it)"
)


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
    (tmp_path / "deploy" / "monitoring" / RULES.name).write_text(
        RULES.read_text().replace("(14.4 * 0.05)", "(6 * 0.05)")
    )
    (tmp_path / "tests" / "deploy" / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(tmp_path / "tests" / "deploy" / RULE_TESTS.name)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "SpecfleetTTFTBudgetBurnFast" in result.stdout + result.stderr


def _services(series: list[dict[str, Any]]) -> set[str]:
    return (
        {m.group(1) for s in series for m in [re.search(r'service="([^"]+)"', s["series"])] if m}
        | {m.group(1) for s in series for m in [re.search(r'deployment="([^"]+)"', s["series"])] if m}
        | {m.group(1) for s in series for m in [re.search(r'pod="([^"]+)"', s["series"])] if m}
    )


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        present = _services(group["input_series"])
        for case in group.get("alert_rule_test", []):
            expected = case.get("exp_alerts") or []
            if expected:
                firing.add(case["alertname"])
            shown = {
                v
                for a in expected
                for k, v in a["exp_labels"].items()
                if k in ("service", "deployment", "pod")
            }
            if not expected or present - shown:
                quiet.add(case["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested not firing"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in markdown.splitlines()
        if line.startswith("#")
    }


def test_every_alert_links_an_existing_runbook_section() -> None:
    anchors = _anchors(RUNBOOKS.read_text())
    for alert in alerts():
        url = alert["annotations"]["runbook_url"]
        assert url.startswith("https://github.com/specfleet/specfleet/blob/main/docs/runbooks.md#"), url
        assert url.split("#", 1)[1] in anchors, f"{alert['alert']}: no section {url} in docs/runbooks.md"
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]


def test_default_slo_thresholds_are_the_crd_defaults_and_bucket_bounds() -> None:
    """A target without the operator's SLO labels is measured against the CRD's default spec.slo."""
    text = RULES.read_text()
    for label, default_ms, buckets in [
        ("slo_ttft_seconds", SLOSpec().ttft_p95_ms, LATENCY_BUCKETS),
        ("slo_tpot_seconds", SLOSpec().tpot_p95_ms, TOKEN_LATENCY_BUCKETS),
    ]:
        defaults = set(re.findall(rf'"{label}", "([^"]*)", "{label}", ""\)', text))
        assert defaults == {f"{default_ms / 1000:g}"}, (label, defaults)
        assert default_ms / 1000 in buckets, f"{default_ms} ms is not a bucket bound"
    assert "_bucket{le=" not in text  # no hard-coded threshold left: each target's own label decides


def test_the_operator_labels_what_the_per_service_rule_tests_feed_in() -> None:
    """The promtool tests' `strict` and `lenient` services carry the labels the operator writes for
    spec.slo {250 ms, 25 ms} and {1000 ms, 100 ms} (labels of the scraped Service, copied by the ServiceMonitor)."""
    from specfleet.operator import load_inference_service
    from specfleet.operator.render import render_service, render_servicemonitor
    from specfleet.operator.render.router import render_engines_service

    tested = {
        (m.group(1), m.group(2), m.group(3))
        for m in re.finditer(
            r'service="(strict|lenient)", pod="[^"]+", (slo_t\w+_seconds)="([^"]+)"', RULE_TESTS.read_text()
        )
    }
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["metadata"].update(namespace="ns", uid="u")
    rendered = set()
    for name, ttft, tpot in (("strict", 250, 25), ("lenient", 1000, 100)):
        doc["metadata"]["name"], doc["spec"]["slo"] = name, {"ttftP95Ms": ttft, "tpotP95Ms": tpot}
        isvc = load_inference_service(doc)
        # the Service the ServiceMonitor scrapes: the engines' headless one behind a router, else the client one
        scraped = render_engines_service(isvc) if isvc.spec.routing.enabled else render_service(isvc)
        labels = scraped["metadata"]["labels"]
        for relabel in render_servicemonitor(isvc)["spec"]["endpoints"][0]["relabelings"]:
            if not relabel["targetLabel"].startswith("slo_"):
                continue  # the pod's role (specfleet_role): not a Service label
            key = next(
                k
                for k in labels
                if "__meta_kubernetes_service_label_" + re.sub(r"[^a-zA-Z0-9]", "_", k)
                == relabel["sourceLabels"][0]
            )
            rendered.add((name, relabel["targetLabel"], labels[key]))
    assert tested == rendered


def test_inferenceservice_and_tuner_series_are_the_operators_own_metrics() -> None:
    """The alerts on an InferenceService's state read only series the operator exports (operator/metrics.py),
    labelled like the engines' (`namespace`, `service`): no kube-state-metrics custom-resource config."""
    from prometheus_client import Gauge
    from specfleet.operator import metrics

    gauges = {
        g._name: set(g._labelnames) for g in vars(metrics).values() if isinstance(g, Gauge)
    }  # private names: prometheus_client exposes no public accessor
    used = set(re.findall(r"(?<![\w:])(specfleet_(?:inferenceservice|tuner)_\w+)", RULES.read_text()))
    assert used and used <= set(gauges), used - set(gauges)
    assert all({"namespace", "service"} <= gauges[name] for name in used), gauges
    assert "kube_state_metrics" not in RULES.read_text() and "customresource" not in RULES.read_text().lower()


def test_engine_series_in_the_rules_exist() -> None:
    """Every specfleet_ engine series an alert or recording rule reads is one the engine exports."""
    from prometheus_client import CollectorRegistry
    from specfleet.engine.server.metrics import ServerMetrics

    registry = CollectorRegistry()
    ServerMetrics("m", registry)
    exported = {s.name for family in registry.collect() for s in family.samples}
    used = set(re.findall(r"(?<![\w:])(specfleet_(?!inferenceservice_|tuner_)\w+)", RULES.read_text()))
    assert used and used <= exported, used - exported


def _scrape_labels(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The target labels the Prometheus Operator gives the engines of one InferenceService through the
    ServiceMonitor the operator renders: one entry per Service it selects, `service` the Service's name and
    `job` its `jobLabel` label (the Prometheus Operator's own relabeling; not run here: no cluster)."""
    from specfleet.operator import load_inference_service
    from specfleet.operator.render import render_service, render_servicemonitor
    from specfleet.operator.render.router import engines_services

    isvc = load_inference_service(doc)
    monitor = render_servicemonitor(isvc)["spec"]
    services = [render_service(isvc), *(engines_services(isvc) if isvc.spec.routing.enabled else [])]
    selected = [
        s["metadata"]
        for s in services
        if monitor["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    return [{"service": m["name"], "job": m["labels"][monitor["jobLabel"]]} for m in selected]


@pytest.mark.parametrize(
    ("example", "routing", "services"),
    [
        ("smollm2-cpu.yaml", True, ["smollm2-engines"]),
        ("smollm2-cpu.yaml", False, ["smollm2"]),
        ("smollm2-cpu-pd.yaml", True, ["smollm2-decode", "smollm2-prefill"]),
    ],
)
def test_engine_alerts_carry_the_inferenceservice_name_whatever_service_was_scraped(
    example: str, routing: bool, services: list[str]
) -> None:
    """Behind the router (the default) the engines' `service` label is `NAME-engines` (or one per role), not
    the InferenceService: the engine rules keep `job`, which is its name in every mode, and the runbooks'
    PromQL selects engine series by it (a `service="NAME"` there finds nothing behind the router)."""
    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    doc["metadata"].update(name="smollm2", namespace="ns", uid="u")
    doc["spec"].setdefault("routing", {})["enabled"] = routing
    if example.endswith("-pd.yaml") and not routing:
        pytest.skip("disaggregation needs the router")
    scraped = _scrape_labels(doc)
    assert sorted(s["service"] for s in scraped) == services
    assert {s["job"] for s in scraped} == {"smollm2"}

    for rule in rules():
        groupings = re.findall(r"\b(?:by|on) \(([^)]*)\)", rule["expr"])
        engine = re.search(r"(?<![\w:])specfleet_(?!inferenceservice_|tuner_)\w+", rule["expr"])
        for labels in groupings if engine else []:
            names = {n.strip() for n in labels.split(",")}
            if "service" in names:
                assert "job" in names, (rule.get("alert") or rule.get("record"), labels)


def test_runbook_promql_selects_engine_series_by_job() -> None:
    """Every PromQL selector in the runbooks and sre.md on an engine series or an engine recording rule
    names the service as the ServiceMonitor labels it in every mode: `job="NAME"`."""
    engine_series = (
        r"(?<![\w:])(?:specfleet_(?!inferenceservice_|tuner_)\w+|namespace_service:\w+:\w+|up)\{([^}]*)\}"
    )
    checked = 0
    for doc in (RUNBOOKS, REPO / "docs" / "sre.md"):
        for matchers in re.findall(engine_series, doc.read_text()):
            if 'namespace="NS"' not in matchers:
                continue  # `specfleet_requests_refused_total{reason}`: a series' labels named in prose
            checked += 1
            assert 'service="NAME"' not in matchers and 'job="NAME"' in matchers, (doc.name, matchers)
    assert checked >= 19  # the runbooks hold 19 such selectors today


def test_the_degraded_runbook_covers_every_reason_the_operator_sets() -> None:
    """SpecfleetInferenceServiceDegraded fires with the condition's `reason` label; its runbook section says
    what to do for each reason the operator sets Degraded=True with (read from the operator's source: the
    conditions it computes, the refused-child reasons and the generated Secrets' conflict reasons)."""
    operator = REPO / "operator"
    conditions, reconcile = (operator / "conditions.py").read_text(), (operator / "reconcile.py").read_text()
    reasons = (
        set(re.findall(r'Cond\(\s*"Degraded",\s*"True",\s*"(\w+)"', conditions))
        | set(re.findall(r'"(Child(?:Forbidden|Invalid|Rejected))"', reconcile))
        | set(re.findall(r'"(\w+SecretConflict)"', reconcile))
    )
    assert {"InvalidSpec", "ReplicaFailure", "ChildForbidden", "AdminSecretConflict"} <= reasons, reasons
    section = RUNBOOKS.read_text().split("## SpecfleetInferenceServiceDegraded", 1)[1].split("\n## ", 1)[0]
    assert {r for r in reasons if f"`{r}`" not in section} == set()


def test_the_runbooks_pod_selectors_list_every_pod_the_operator_runs() -> None:
    """`kubectl get pods -l ...=NAME` in the runbooks finds every pod template the operator renders for a
    service, the router's included (its unready pods also make Ready=False/ReplicasNotReady), with routing
    on, off and disaggregated; and no selector in them finds nothing."""
    from specfleet.operator import load_inference_service
    from specfleet.operator.render import render_engine_workloads, render_router_deployment

    selectors = set(re.findall(r"kubectl get pods -n NS -l ([\w./-]+)=NAME", RUNBOOKS.read_text()))
    used: set[str] = set()
    for example, routing in (
        ("smollm2-cpu.yaml", True),
        ("smollm2-cpu.yaml", False),
        ("smollm2-cpu-pd.yaml", True),
    ):
        doc = yaml.safe_load((REPO / "examples" / example).read_text())
        doc["metadata"].update(name="name", namespace="ns", uid="u")
        doc["spec"].setdefault("routing", {})["enabled"] = routing
        isvc = load_inference_service(doc)
        workloads = [*render_engine_workloads(isvc), *([render_router_deployment(isvc)] if routing else [])]
        for workload in workloads:
            labels = workload["spec"]["template"]["metadata"]["labels"]
            found = {key for key in selectors if labels.get(key) == "name"}
            assert found, (example, routing, workload["metadata"]["name"], sorted(selectors))
            used |= found
    assert used == selectors


def test_the_runbooks_read_the_leading_operators_log() -> None:
    """The chart runs more than one operator replica and only the Lease holder reconciles and tunes, so
    `kubectl logs deploy/...` (one replica, either) may show a standby that logs nothing of the service:
    the runbooks take the pod from the Lease the chart names (release `specfleet`), whose holder identity is
    the pod's name, then `_`."""
    import socket

    import helm_python as helm
    from specfleet.operator.leadership import default_identity

    with helm.Chart.load(REPO / "charts" / "specfleet") as chart:
        rendered = chart.render(values=None, name="specfleet", namespace="specfleet-system", is_install=True)
    (deployment,) = [
        d
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "specfleet-operator"
    ]
    assert deployment["spec"]["replicas"] > 1
    (args,) = [
        c["args"] for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"
    ]
    lease = next(a.split("=", 1)[1] for a in args if a.startswith("--leader-election-id="))
    assert default_identity().split("_")[0] == socket.gethostname()

    text = RUNBOOKS.read_text()
    assert f"get lease {lease} -o jsonpath='{{.spec.holderIdentity}}' | cut -d_ -f1)" in text
    assert not re.search(r"kubectl[^\n]*logs[^\n]*deploy/", text), (
        "logs of a Deployment: either replica, maybe the standby"
    )
    assert re.findall(r"logs -n specfleet-system (\S+)", text) + re.findall(
        r"specfleet-system logs (\S+)", text
    )


def test_every_field_the_sre_docs_name_is_in_the_crd() -> None:
    """The `spec.`/`status.` paths the runbooks and sre.md tell the on-call to read or set exist in the CRD's
    schema (a renamed field would leave a runbook step that `kubectl` refuses or that reads nothing)."""
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def exists(path: str) -> bool:
        node = schema
        for part in path.split("."):
            node = (node.get("properties") or {}).get(part)
            if node is None:
                return False
        return True

    paths = {
        path
        for doc in (RUNBOOKS, REPO / "docs" / "sre.md")
        for path in re.findall(r"`((?:spec|status)\.[\w.]+)`", doc.read_text())
    }
    assert len(paths) >= 15 and {p for p in paths if not exists(p)} == set()
