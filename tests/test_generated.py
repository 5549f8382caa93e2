"""Every derived file is what `python -m specfleet.operator.generate` writes from its source, and its
`--check` names each stale one (the CRD copies, the chart's monitoring files, the kustomize overlays, the
Argo CD snippet, the package lists in pyproject.toml and the Dockerfiles)."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from specfleet.engine.python_child import python_command
from specfleet.operator import generate

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python -m specfleet.operator.generate"


def _check(root: Path) -> tuple[int, str]:
    """`--check` over the tree at root: the exit status and what it printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = generate.main(["--check", "--root", str(root)])
    return status, err.getvalue()


def test_every_derived_file_is_up_to_date() -> None:
    """As .ci/check runs it: `python -m` from the repository root (where the folder operator/ sits)."""
    result = subprocess.run(
        python_command("-m", "specfleet.operator.generate", "--check"),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the generator reads and writes: the package folders' sources, deploy/, charts/,
    examples/, crds/, pyproject.toml."""
    root = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "results")
    for folder in [*generate.package_dir(REPO).values(), "deploy", "charts", "examples", "crds"]:
        shutil.copytree(REPO / folder, root / folder, ignore=skip)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_check_names_each_stale_file_and_generate_rewrites_it(tree: Path) -> None:
    rules = tree / "deploy" / "monitoring" / "prometheus-rules.yaml"
    rules.write_text(rules.read_text() + "# a new rule\n")
    example = tree / "examples" / "smollm2-cpu.yaml"
    example.write_text(example.read_text().replace("replicas: 1", "replicas: 2"))
    script = tree / "deploy" / "argocd" / "inferenceservice-health.lua"
    script.write_text("-- a new first line\n" + script.read_text())
    crd = tree / "crds" / "inferenceservice.yaml"
    crd.write_text(crd.read_text() + "# edited by hand\n")
    (tree / "engine" / "newpart").mkdir()
    (tree / "engine" / "newpart" / "__init__.py").write_text("")

    status, err = _check(tree)
    stale = {line.split(" is stale")[0] for line in err.splitlines()}
    assert status == 1
    assert stale == {
        "charts/specfleet/files/prometheus-rules.yaml",
        "deploy/kustomize/overlays/cpu-demo/inferenceservice.yaml",
        "deploy/argocd/argocd-cm.yaml",
        "crds/inferenceservice.yaml",
        "pyproject.toml",
    }, err
    assert all(line.endswith(f"run `{COMMAND}` and commit the result") for line in err.splitlines())

    assert generate.main(["--root", str(tree)]) == 0
    assert _check(tree) == (0, "")
    assert (
        tree / "charts" / "specfleet" / "files" / "prometheus-rules.yaml"
    ).read_text() == rules.read_text()
    overlay = tree / "deploy" / "kustomize" / "overlays" / "cpu-demo" / "inferenceservice.yaml"
    assert overlay.read_text().endswith(example.read_text())
    cm = yaml.safe_load((tree / "deploy" / "argocd" / "argocd-cm.yaml").read_text())
    assert (
        cm["data"]["resource.customizations.health.serving.specfleet.io_InferenceService"]
        == script.read_text()
    )
    assert "# edited by hand" not in crd.read_text()
    config = tomllib.loads((tree / "pyproject.toml").read_text())
    assert "specfleet.engine.newpart" in config["tool"]["setuptools"]["packages"]


def test_a_new_package_folder_reaches_every_package_list(tree: Path) -> None:
    """One line in package-dir: the packages, import-linter's roots and every Dockerfile follow."""
    (tree / "gateway").mkdir()
    (tree / "gateway" / "__init__.py").write_text("")
    pyproject = tree / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace(
            '"specfleet.sim" = "sim" }', '"specfleet.sim" = "sim", "specfleet.gateway" = "gateway" }'
        )
    )
    stale = {line.split(" is stale")[0] for line in _check(tree)[1].splitlines()}
    assert stale == {
        "pyproject.toml",
        *generate.DOCKERFILES,
        *(f"{d}.dockerignore" for d in generate.DOCKERFILES),
    }

    assert generate.main(["--root", str(tree)]) == 0
    config = tomllib.loads(pyproject.read_text())
    assert "specfleet.gateway" in config["tool"]["setuptools"]["packages"]
    assert "specfleet.gateway" in config["tool"]["importlinter"]["root_packages"]
    for dockerfile in generate.DOCKERFILES:
        assert "COPY gateway ./gateway\n" in (tree / dockerfile).read_text()
        assert "!gateway/**\n" in (tree / f"{dockerfile}.dockerignore").read_text()


def test_a_file_without_its_markers_is_refused_by_name(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dockerfile = tree / "operator" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace(generate.END, "# the end"))
    assert generate.main(["--check", "--root", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "operator/Dockerfile" in err and generate.END in err
