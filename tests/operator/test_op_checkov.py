"""Security posture, measured by checkov over what a user installs: the chart rendered with every optional
object on (the NetworkPolicy, the monitoring objects, a watched namespace), and every object the operator
renders for each example InferenceService under the operator config that chart gives it (router,
NetworkPolicy, tuned ConfigMap included), plus a multi-node service's LeaderWorkerSet.

Each finding must be fixed or accepted, with its reason, in checkov_baseline.yaml; a new finding fails, and
so does an accepted one that is gone (stale), a pattern that also covers a resource passing the same check,
and a finding that two entries accept. Every kind the operator writes (operator/kube.py KINDS) and every kind
a chart template renders must be in the scan, and each scanned kind is either checked by checkov or listed,
with the reason, under `unchecked_kinds`."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from isvc_schema_tools import EXAMPLES, REPO
from specfleet.operator import load_inference_service
from specfleet.operator.config import OperatorConfig
from specfleet.operator.inference_service import InferenceService
from specfleet.operator.kube import KINDS
from specfleet.operator.render import (
    new_admin_token,
    render_engine_workloads,
    render_network_policy,
    render_pdb,
    render_router_children,
    render_secret,
    render_service,
    render_servicemonitor,
    render_tuned_config,
)
from specfleet.operator.resources import KIND
from test_op_chart import CHART, NS
from test_op_chart import render as render_chart
from test_op_roles import multinode_doc

CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"  # its own venv, made by .ci/setup (says why)
BASELINE = Path(__file__).with_name("checkov_baseline.yaml")
USER_NAMESPACE = "team-a"  # the operator renders children into the InferenceService's own namespace
# Every object the chart can render: a watched namespace of its own (Namespace, Role), the operator's
# NetworkPolicy switch, the monitoring objects without waiting for their CRDs (helm template sees none).
CHART_VALUES: dict[str, Any] = {
    "watch": {"namespaces": [USER_NAMESPACE]},
    "networkPolicy": {"enabled": True},
    "monitoring": {
        "prometheusRule": {"enabled": True, "requireCRD": False},
        "podMonitor": {"enabled": True, "requireCRD": False},
        "grafanaDashboard": {"enabled": True},
    },
}


def operator_config(chart: list[dict[str, Any]]) -> OperatorConfig:
    """The config the chart's operator Deployment runs with: its container's environment, POD_NAMESPACE
    resolved to the release namespace as its fieldRef is."""
    (deployment,) = [o for o in chart if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return OperatorConfig.from_env({**env, "POD_NAMESPACE": NS})


def operator_children(isvc: InferenceService, config: OperatorConfig) -> list[dict[str, Any]]:
    """What the reconcile and the tuner apply for one service (operator/reconcile.py, tuner/handlers.py)."""
    children = [
        *render_engine_workloads(isvc, config),
        render_service(isvc),
        render_secret(isvc, new_admin_token()),
        render_pdb(isvc),
        render_servicemonitor(isvc),
        *render_router_children(isvc, config),
    ]
    if config.network_policy:
        children.append(render_network_policy(isvc, config))
    if isvc.spec.autotune.enabled:  # the tuner's NAME-tuned, as first written: the spec's start values
        children.append(render_tuned_config(isvc, isvc.spec.start_values()))
    return [child for child in children if child]


def template_pods(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's leader and worker pod templates as Pods: checkov reads no custom kind's templates,
    and the worker's differs from the engine Deployments' (no server, no probes)."""
    templates = workload["spec"]["leaderWorkerTemplate"]
    meta = workload["metadata"]
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **templates[part].get("metadata", {}),
                "name": f"{meta['name']}-{role}",
                "namespace": meta["namespace"],
            },
            "spec": templates[part]["spec"],
        }
        for part, role in (("leaderTemplate", "leader"), ("workerTemplate", "worker"))
    ]


def rendered_objects() -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects a user ends up with: the chart, and each service's children."""
    chart, _ = render_chart(CHART_VALUES)
    config = operator_config(chart)
    assert config.network_policy, "the scan's chart values no longer turn the operator's NetworkPolicy on"
    docs = [(path.stem, yaml.safe_load(path.read_text())) for path in EXAMPLES]
    docs.append(("multinode", multinode_doc()))  # engine.nodes > 1: no example runs across pods yet
    picker = yaml.safe_load((EXAMPLES[0].parent / "smollm2-cpu.yaml").read_text())  # routing.mode
    picker["spec"]["routing"] = {"mode": "endpoint-picker", "endpointPicker": {"gateway": {"name": "gw"}}}
    docs.append(("endpoint-picker", picker))
    files = {"chart.yaml": chart}
    for stem, doc in docs:
        doc["metadata"].update(namespace=USER_NAMESPACE, uid="uid-1234")
        children = operator_children(load_inference_service(doc), config)
        pods = [pod for c in children if c["kind"] == "LeaderWorkerSet" for pod in template_pods(c)]
        files[f"isvc-{stem}.yaml"] = [*children, *pods]
    return files


def chart_kinds() -> set[str]:
    """Every top-level `kind:` the chart's templates can render."""
    return {
        kind
        for template in (CHART / "templates").glob("*.yaml")
        for kind in re.findall(r"^kind:\s*(\w+)\s*$", template.read_text(), re.MULTILINE)
    }


def run_checkov(folder: Path) -> dict[str, Any]:
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run `bash .ci/setup`, which installs checkov in its own venv")
    # --skip-download: no policies or guidelines fetched from the network; the checks are those of the pin.
    proc = subprocess.run(
        [
            str(CHECKOV),
            "--directory",
            str(folder),
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--compact",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=300,
    )
    assert proc.returncode in (0, 1), f"checkov failed to run:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def load_baseline() -> tuple[list[dict[str, Any]], dict[str, str]]:
    baseline = yaml.safe_load(BASELINE.read_text())
    assert set(baseline) == {"findings", "unchecked_kinds"}, set(baseline)
    for entry in baseline["findings"]:
        assert set(entry) == {"check", "title", "resources", "reason"} and len(entry["reason"]) > 40, entry
    for kind, reason in baseline["unchecked_kinds"].items():
        assert len(reason) > 40, (kind, reason)
    return baseline["findings"], baseline["unchecked_kinds"]


def covers(entry: dict[str, Any], check: str, resource: str) -> bool:
    return entry["check"] == check and any(fnmatch.fnmatchcase(resource, p) for p in entry["resources"])


@pytest.mark.slow
def test_checkov_findings_are_exactly_the_accepted_ones(tmp_path: Path) -> None:
    files = rendered_objects()
    scanned = {obj["kind"] for objects in files.values() for obj in objects}
    operator_kinds = {
        obj["kind"] for name, objects in files.items() if name != "chart.yaml" for obj in objects
    }
    missing = sorted({*(set(KINDS) - {KIND} - operator_kinds), *(chart_kinds() - scanned)})
    assert not missing, f"rendered kinds not in the scan (add them to rendered_objects): {missing}"
    for name, objects in files.items():
        (tmp_path / name).write_text(yaml.safe_dump_all(objects))
    report = run_checkov(tmp_path)
    summary = report["summary"]
    print(
        f"checkov {summary['checkov_version']}: {summary['passed']} passed, {summary['failed']} failed "
        f"over {summary['resource_count']} resources"
    )
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 20, summary
    entries, unchecked = load_baseline()
    results = report["results"]
    failed = {(f["check_id"], f["resource"], f["check_name"]) for f in results["failed_checks"]}
    passed = {(f["check_id"], f["resource"]) for f in results["passed_checks"]}

    checked = {r.split(".", 1)[0] for _, r in passed} | {r.split(".", 1)[0] for _, r, _ in failed}
    silent = sorted(scanned - checked - set(unchecked))
    assert not silent, f"checkov checks none of these kinds; say why under unchecked_kinds: {silent}"
    stale_kinds = sorted(set(unchecked) & checked)
    assert not stale_kinds, f"checkov now checks these; remove them from unchecked_kinds: {stale_kinds}"
    unscanned = sorted(set(unchecked) - scanned)
    assert not unscanned, f"unchecked_kinds lists kinds the scan no longer renders: {unscanned}"

    new, twice, renamed = [], [], []
    for check, resource, title in sorted(failed):
        accepting = [e for e in entries if covers(e, check, resource)]
        if not accepting:
            new.append(f"{check} {title} on {resource}")
        twice += [f"{check} on {resource}"] if len(accepting) > 1 else []
        renamed += [
            f"{e['check']}: {e['title']!r} is now {title!r}" for e in accepting if e["title"] != title
        ]
    assert not new, (
        "new checkov findings: fix them or accept them with a reason in checkov_baseline.yaml:\n"
        + "\n".join(new)
    )
    assert not twice, f"findings accepted by two entries (one reason each): {twice}"
    assert not renamed, f"baseline titles differ from checkov's: {sorted(set(renamed))}"
    stale = [
        f"{entry['check']} {pattern}"
        for entry in entries
        for pattern in entry["resources"]
        if not any(
            check == entry["check"] and fnmatch.fnmatchcase(resource, pattern)
            for check, resource, _ in failed
        )
    ]
    assert not stale, f"checkov no longer finds these; remove them from checkov_baseline.yaml: {stale}"
    broad = sorted(
        f"{check} {resource}" for check, resource in passed for e in entries if covers(e, check, resource)
    )
    assert not broad, f"baseline patterns that also cover resources passing the check (narrow them): {broad}"
    # the operator's NetworkPolicy is in the scan: every engine pod passes checkov's NetworkPolicy check
    engines = [
        o["metadata"]["name"]
        for name, objects in files.items()
        if name != "chart.yaml"
        for o in objects
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"].get("app.kubernetes.io/name") == "specfleet-engine"
    ]
    covered = {r for check, r in passed if check == "CKV2_K8S_6"}
    bare = [e for e in engines if not any(r.startswith(f"Pod.{USER_NAMESPACE}.{e}.") for r in covered)]
    assert engines and not bare, f"engine pods without a NetworkPolicy in the scan: {bare}"
