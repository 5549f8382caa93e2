"""Security posture, measured by checkov over what a user installs: the rendered chart and the children the
operator renders for every example InferenceService. Each finding must be fixed or accepted, with its reason,
in checkov_baseline.yaml; a new finding fails, and so does an accepted one that is gone (stale)."""

from __future__ import annotations

import fnmatch
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from isvc_schema_tools import EXAMPLES, REPO
from specfleet.operator import load_inference_service
from specfleet.operator.render import (
    new_admin_token,
    render_deployment,
    render_pdb,
    render_secret,
    render_service,
    render_servicemonitor,
)
from test_op_chart import render as render_chart

CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"  # its own venv, made by .ci/setup (says why)
BASELINE = Path(__file__).with_name("checkov_baseline.yaml")
USER_NAMESPACE = "team-a"  # the operator renders children into the InferenceService's own namespace


def rendered_objects() -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects a user ends up with: the chart, and each example's children."""
    objects, _ = render_chart(None)
    files = {"chart.yaml": objects}
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        doc["metadata"].update(namespace=USER_NAMESPACE, uid="uid-1234")
        isvc = load_inference_service(doc)
        children = [
            render_deployment(isvc),
            render_service(isvc),
            render_secret(isvc, new_admin_token()),
            render_pdb(isvc),
            render_servicemonitor(isvc),
        ]
        files[f"isvc-{path.stem}.yaml"] = [child for child in children if child]
    return files


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


def test_checkov_findings_are_exactly_the_accepted_ones(tmp_path: Path) -> None:
    for name, objects in rendered_objects().items():
        (tmp_path / name).write_text(yaml.safe_dump_all(objects))
    report = run_checkov(tmp_path)
    summary = report["summary"]
    print(
        f"checkov {summary['checkov_version']}: {summary['passed']} passed, {summary['failed']} failed "
        f"over {summary['resource_count']} resources"
    )
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 20, summary
    baseline = yaml.safe_load(BASELINE.read_text())
    for entry in baseline:
        assert set(entry) == {"check", "title", "resources", "reason"} and len(entry["reason"]) > 40, entry
    findings = {(f["check_id"], f["resource"], f["check_name"]) for f in report["results"]["failed_checks"]}
    accepted = {
        (check, resource)
        for check, resource, _ in findings
        for entry in baseline
        if entry["check"] == check
        and any(fnmatch.fnmatchcase(resource, pattern) for pattern in entry["resources"])
    }
    new = sorted(
        f"{check} {title} on {resource}"
        for check, resource, title in findings
        if (check, resource) not in accepted
    )
    assert not new, (
        "new checkov findings: fix them or accept them with a reason in checkov_baseline.yaml:\n"
        + "\n".join(new)
    )
    stale = [
        f"{entry['check']} {pattern}"
        for entry in baseline
        for pattern in entry["resources"]
        if not any(
            check == entry["check"] and fnmatch.fnmatchcase(resource, pattern) for check, resource in accepted
        )
    ]
    assert not stale, f"checkov no longer finds these; remove them from checkov_baseline.yaml: {stale}"
