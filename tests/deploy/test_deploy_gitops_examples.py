"""The Argo CD and Flux examples validate against the upstream CRDs (vendored, versions in VERSIONS) and
point at paths and values that exist in this repository."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import crd_errors

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "gitops-examples"
CRDS = REPO / "tests" / "fixtures" / "crds"
CRD_FOR = {
    ("argoproj.io", "Application"): CRDS / "argocd-application-crd.yaml",
    ("kustomize.toolkit.fluxcd.io", "Kustomization"): CRDS / "flux-kustomization.yaml",
    ("helm.toolkit.fluxcd.io", "HelmRelease"): CRDS / "flux-helmrelease.yaml",
    ("source.toolkit.fluxcd.io", "GitRepository"): CRDS / "flux-gitrepository.yaml",
}
DOCS = [
    (path.name, i, doc)
    for path in sorted(EXAMPLES.glob("*.yaml"))
    for i, doc in enumerate(yaml.safe_load_all(path.read_text()))
    if doc
]


def test_every_vendored_crd_has_its_version_noted() -> None:
    noted = {
        line.split()[0]
        for line in (CRDS / "VERSIONS").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert noted == {p.name for p in CRDS.glob("*.yaml")}


def test_vendored_crd_slices_match_their_pins() -> None:
    """Each CRD here is the slice slice_crds.py cut from the upstream file VERSIONS pins: its checksum is
    pinned, and slicing it again leaves it unchanged (no hand edits, KEEP and the files agree)."""
    spec = importlib.util.spec_from_file_location("slice_crds", CRDS / "slice_crds.py")
    assert spec is not None and spec.loader is not None
    slicer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slicer)
    assert slicer.check() == []
    for row in slicer.read_versions():
        header = (CRDS / row[0]).read_text().splitlines()[0]
        assert f"from {row[1]} {row[2]} {row[3]} (sha256 {row[4]})" in header


@pytest.mark.parametrize("doc", [d for _, _, d in DOCS], ids=[f"{name}#{i}" for name, i, _ in DOCS])
def test_example_validates_against_its_upstream_crd(doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"].rsplit("/", 1)[0], doc["kind"])
    assert key in CRD_FOR, f"no vendored CRD for {key}"
    assert crd_errors(CRD_FOR[key], doc) == []


def test_the_validator_rejects_what_the_api_server_would() -> None:
    (app,) = [d for name, _, d in DOCS if d["kind"] == "Application"]
    typo = {**app, "spec": {**app["spec"], "syncPolicy": {**app["spec"]["syncPolicy"], "automatic": {}}}}
    assert any("automatic" in e for e in crd_errors(CRD_FOR[("argoproj.io", "Application")], typo))
    (release,) = [d for name, _, d in DOCS if d["kind"] == "HelmRelease"]
    wrong = {**release, "spec": {**release["spec"], "install": {"crds": "Sometimes"}}}
    assert crd_errors(CRD_FOR[("helm.toolkit.fluxcd.io", "HelmRelease")], wrong)


def _chart_values_known(values: dict[str, Any], defaults: dict[str, Any], path: str = "") -> list[str]:
    unknown = []
    for key, value in values.items():
        if key not in defaults:
            unknown.append(f"{path}{key}")
        elif isinstance(value, dict) and isinstance(defaults[key], dict) and defaults[key]:
            unknown += _chart_values_known(value, defaults[key], f"{path}{key}.")
    return unknown


def test_examples_point_at_this_repository() -> None:
    defaults = yaml.safe_load((REPO / "charts" / "specfleet" / "values.yaml").read_text())
    for _, _, doc in DOCS:
        spec = doc["spec"]
        if doc["kind"] == "Application":
            assert (REPO / spec["source"]["path"] / "Chart.yaml").exists()
            assert _chart_values_known(spec["source"]["helm"]["valuesObject"], defaults) == []
        elif doc["kind"] == "Kustomization":
            assert (REPO / spec["path"] / "kustomization.yaml").exists()
        elif doc["kind"] == "HelmRelease":
            assert (REPO / spec["chart"]["spec"]["chart"] / "Chart.yaml").exists()
            assert _chart_values_known(spec["values"], defaults) == []
