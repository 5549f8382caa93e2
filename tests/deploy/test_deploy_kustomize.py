"""deploy/kustomize builds with a real `kubectl kustomize`, and its objects are the Helm chart's (rendered by
Helm's own engine) with the matching values; every manifest is server-side-apply clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from crd_schema import crd_errors

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO / "deploy" / "kustomize"
CRD = REPO / "crds" / "inferenceservice.yaml"
NAMESPACE = "specfleet-system"
RELEASE = "specfleet"
# overlay -> (the chart values it matches, the example InferenceService it carries)
OVERLAYS = {
    "base": (None, None),
    "overlays/cpu-demo": (None, "smollm2-cpu.yaml"),
    "overlays/gpu": (
        {"prometheusURL": "http://prometheus-operated.monitoring.svc:9090"},
        "llama3-8b-autotune.yaml",
    ),
}
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is missing: .ci/setup installs kubernetes-client"
)


def kustomize(folder: str) -> list[dict[str, Any]]:
    result = subprocess.run([KUBECTL, "kustomize", str(KUSTOMIZE / folder)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def helm_objects(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    with helm.Chart.load(REPO / "charts" / "specfleet") as chart:
        rendered = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _drop_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    def clean(meta: dict[str, Any]) -> None:
        for label in HELM_ONLY_LABELS:
            meta.get("labels", {}).pop(label, None)

    clean(obj["metadata"])
    template = obj.get("spec", {}).get("template")
    if isinstance(template, dict) and "metadata" in template:
        clean(template["metadata"])
    return obj


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects}


@pytest.mark.parametrize("folder", OVERLAYS)
def test_kustomize_matches_the_helm_chart(folder: str) -> None:
    values, _ = OVERLAYS[folder]
    ours = by_key(
        [
            o
            for o in kustomize(folder)
            if o["kind"] not in ("Namespace", "CustomResourceDefinition", "InferenceService")
        ]
    )
    # the chart's CRD (a template, with Helm's keep annotation) is compared with crds/ in test_op_chart
    theirs = by_key(
        [_drop_helm_labels(o) for o in helm_objects(values) if o["kind"] != "CustomResourceDefinition"]
    )
    assert sorted(ours) == sorted(theirs)
    for key, obj in theirs.items():
        assert ours[key] == obj, f"{key} differs from the chart's"


@pytest.mark.parametrize("folder", OVERLAYS)
def test_kustomize_ships_the_generated_crd_and_the_examples(folder: str) -> None:
    objects = kustomize(folder)
    (crd,) = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert crd == yaml.safe_load(CRD.read_text()), (
        "deploy/kustomize/base/crds/inferenceservice.yaml is stale: run `python -m specfleet.operator.generate`"
    )
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == NAMESPACE
    services = [o for o in objects if o["kind"] == "InferenceService"]
    _, example = OVERLAYS[folder]
    if example is None:
        assert services == []
        return
    (isvc,) = services
    expected = yaml.safe_load((REPO / "examples" / example).read_text())
    expected["metadata"]["namespace"] = NAMESPACE  # the operator watches its own namespace by default
    assert isvc == expected, (
        f"deploy/kustomize/{folder}/inferenceservice.yaml is stale: run `python -m specfleet.operator.generate`"
    )
    assert crd_errors(CRD, isvc) == []


def _nulls(value: Any, path: str = "") -> list[str]:
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nulls(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _nulls(v, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("folder", OVERLAYS)
def test_every_manifest_is_server_side_apply_clean(folder: str) -> None:
    for obj in kustomize(folder):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        assert "status" not in obj, f"{name}: status in a manifest"
        server_owned = {"creationTimestamp", "resourceVersion", "uid", "generation", "managedFields"}
        assert server_owned.isdisjoint(obj["metadata"]), f"{name}: server-owned metadata"
        assert _nulls(obj) == [], (
            f"{name}: null fields {_nulls(obj)} (the API server drops them: a diff each apply)"
        )
        if obj["kind"] not in ("InferenceService", "CustomResourceDefinition"):
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_a_drifted_overlay_is_caught(tmp_path: Path) -> None:
    """The comparison can fail: a base whose Role lost a rule no longer matches the chart."""
    copy = tmp_path / "kustomize"
    shutil.copytree(KUSTOMIZE, copy)
    rbac = copy / "base" / "rbac.yaml"
    every = 'verbs: ["get", "list", "watch", "create", "patch", "delete"]'
    assert every in rbac.read_text()  # a rule to cut, else the comparison below proves nothing
    rbac.write_text(rbac.read_text().replace(every, 'verbs: ["get"]'))
    result = subprocess.run(
        [KUBECTL, "kustomize", str(copy / "base")], capture_output=True, text=True, check=True
    )
    ours = by_key([o for o in yaml.safe_load_all(result.stdout) if o])
    theirs = by_key([_drop_helm_labels(o) for o in helm_objects(None)])
    key = ("Role", NAMESPACE, f"{RELEASE}-operator")
    assert ours[key] != theirs[key]
