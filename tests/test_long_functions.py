"""No function in product code runs over 80 lines unless its docstring says why ("Kept long because ...").

Product code is every package folder in pyproject.toml's package-dir. A long function is usually several
steps that want names of their own; the few that are one unit (a Triton kernel body, a command's flag
declarations) keep their length and say so.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The limit issue 35 set: about a screen, past which a reader loses the function's steps.
MAX_LINES = 80
REASON = "Kept long because"


def _long_functions() -> list[str]:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for folder in sorted(package_dir.values()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES and REASON not in (ast.get_docstring(node) or ""):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_walk_sees_the_product_packages() -> None:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {"engine", "kernels", "operator", "tuner"} <= set(package_dir.values())
    assert all((ROOT / folder / "__init__.py").is_file() for folder in package_dir.values())


def test_no_long_function_without_a_reason() -> None:
    long = _long_functions()
    assert not long, (
        f"functions over {MAX_LINES} lines: split them by what they do, or say in the docstring "
        f"'{REASON} ...':\n" + "\n".join(long)
    )
