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
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(KUSTOMIZE / folder)], capture_output=True, text=True
    )
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
        [str(KUBECTL), "kustomize", str(copy / "base")], capture_output=True, text=True, check=True
    )
    ours = by_key([o for o in yaml.safe_load_all(result.stdout) if o])
    theirs = by_key([_drop_helm_labels(o) for o in helm_objects(None)])
    key = ("Role", NAMESPACE, f"{RELEASE}-operator")
    assert ours[key] != theirs[key]


GITOPS = REPO / "deploy" / "gitops-examples"


def _crd_from(source: str) -> dict[str, Any]:
    """The CRD as a GitOps tool applies it: `kubectl kustomize` of a folder, or the chart rendered with the
    values of the shipped Argo CD Application or Flux HelmRelease (`helm template`, as both tools do)."""
    if source == "argocd-application":
        values = yaml.safe_load((GITOPS / "argocd-application.yaml").read_text())["spec"]["source"]["helm"][
            "valuesObject"
        ]
        objects = helm_objects(values)
    elif source == "flux-helmrelease":
        objects = helm_objects(
            yaml.safe_load((GITOPS / "flux-helmrelease.yaml").read_text())["spec"]["values"]
        )
    else:
        objects = kustomize(source)
    (crd,) = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    return crd


@pytest.mark.parametrize("source", [*OVERLAYS, "argocd-application", "flux-helmrelease"])
def test_no_gitops_tool_deletes_the_crd(source: str) -> None:
    """Deleting the CRD deletes every InferenceService in the cluster. Argo CD reads Helm's keep policy as
    Delete=false only, so `crds.install=false` (or a base dropped from Git) under the example's automated
    prune would delete it, and Flux's kustomize-controller prunes it when its Kustomization is deleted.
    Every copy a GitOps tool applies carries Argo CD's Prune=false,Delete=false and Flux's prune: disabled."""
    annotations = _crd_from(source)["metadata"].get("annotations") or {}
    options = {
        name.strip(): value.strip()
        for name, _, value in (
            item.partition("=") for item in annotations.get("argocd.argoproj.io/sync-options", "").split(",")
        )
    }
    assert (options.get("Prune"), options.get("Delete")) == ("false", "false"), annotations
    assert annotations.get("kustomize.toolkit.fluxcd.io/prune") == "disabled", annotations
    if source in ("argocd-application", "flux-helmrelease"):
        assert annotations.get("helm.sh/resource-policy") == "keep", annotations
