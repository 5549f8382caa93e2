"""The namespaced layout works: stdlib `operator` is never shadowed, and wheel + editable installs import."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name, from pyproject.toml's package-dir (the one list; `packages` is generated from it)
FOLDERS = {
    folder: name
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}


def _run(code: str, cwd: Path, *flags: str) -> str:
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_stdlib_operator_is_not_shadowed_from_repo_root():
    out = _run("import operator, specfleet.operator as o; print(operator.__file__); print(o.__file__)", ROOT)
    stdlib, ours = out.splitlines()
    assert Path(stdlib).parent == Path(sysconfig.get_paths()["stdlib"])
    assert Path(ours) == ROOT / "operator" / "__init__.py"
    assert _run("import operator; print(operator.itemgetter(1)([5, 6]))", ROOT) == "6"


@pytest.mark.slow
def test_wheel_builds_and_imports(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("specfleet-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for package in FOLDERS.values():
        assert f"{package.replace('.', '/')}/__init__.py" in names
    assert "specfleet/kernels/cpu/native.cpp" in names  # the native CPU kernels build from it on first use
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import specfleet.engine, specfleet.operator, specfleet.kernels, operator; "
        "print(specfleet.engine.__file__); print(operator.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(target)},
    ).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert "site-packages" not in out[1] or "specfleet" not in out[1]


def test_console_script_lists_commands():
    exe = Path(sys.executable).parent / "specfleet"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "up", "operator", "bench offline", "bench spec"):
        assert command in out
