"""The namespaced layout works: stdlib `operator` is never shadowed, wheel + editable installs import, and
every Python child starts without the working directory on sys.path (engine/python_child.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from specfleet.engine.python_child import python_command

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name, from pyproject.toml's package-dir (the one list; `packages` is generated from it)
FOLDERS = {
    folder: name
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}


def _run(code: str, cwd: Path) -> str:
    """A bare `python -c` in `cwd`, the working directory first on sys.path: what the layout must survive."""
    bare = [sys.executable, "-c", code]  # bare: python_command would add -P, which hides what is tested here
    return subprocess.run(bare, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_stdlib_operator_is_not_shadowed_from_repo_root():
    out = _run("import operator, specfleet.operator as o; print(operator.__file__); print(o.__file__)", ROOT)
    stdlib, ours = out.splitlines()
    assert Path(stdlib).parent == Path(sysconfig.get_paths()["stdlib"])
    assert Path(ours) == ROOT / "operator" / "__init__.py"
    assert _run("import operator; print(operator.itemgetter(1)([5, 6]))", ROOT) == "6"


@pytest.mark.slow
def test_wheel_builds_and_imports(tmp_path):
    subprocess.run(
        python_command(
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ),
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
        python_command("-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)),
        check=True,
        capture_output=True,
    )
    code = (
        "import specfleet.engine, specfleet.operator, specfleet.kernels, operator; "
        "print(specfleet.engine.__file__); print(operator.__file__)"
    )
    out = subprocess.run(
        python_command("-c", code),
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


# Where a child may start as `[sys.executable, ...]` without -P, and why.
BARE_CHILDREN = {
    "engine/python_child.py": "the helper itself",
    "tests/test_packaging.py": "the shadowing test starts a bare interpreter in the repository root on purpose",
    "bench/gguf_random_llama.py": "llama.cpp's convert_hf_to_gguf.py needs its own folder on sys.path",
}


def test_python_children_leave_the_working_directory_off_sys_path() -> None:
    """transformers >= 5.25 imports Hugging Face's `kernels` at its first config import; a child started in
    the repository root with the root on sys.path finds ./kernels instead and dies. Every child command goes
    through `python_command` (which adds -P): a list that starts with `sys.executable` is one that does not."""
    bare = []
    for folder in [*FOLDERS, "tests", "e2e"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(), name)):
                if isinstance(node, ast.List | ast.Tuple) and node.elts:
                    if ast.unparse(node.elts[0]) == "sys.executable" and name not in BARE_CHILDREN:
                        bare.append(f"{name}:{node.lineno}")
    assert not bare, f"start these with specfleet.engine.python_child.python_command: {bare}"
