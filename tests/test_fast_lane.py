"""The fast lane's rule stays exact: tests/conftest.py marks `slow` every test that asks for a fixture in
SLOW_FIXTURES, so a fixture renamed or removed without updating the set would drop the tests that start
engines and servers into `pytest -m "not slow"` without a word."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def defined_fixtures() -> set[str]:
    """Names of the functions under tests/ decorated with `pytest.fixture` (called or not)."""
    names = set()
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                "fixture" in ast.unparse(d) for d in node.decorator_list
            ):
                names.add(node.name)
    return names


def test_every_slow_fixture_is_a_fixture_of_the_tests(request: pytest.FixtureRequest) -> None:
    (slow,) = [
        p.SLOW_FIXTURES for p in request.config.pluginmanager.get_plugins() if hasattr(p, "SLOW_FIXTURES")
    ]
    missing = sorted(slow - defined_fixtures())
    assert not missing, f"SLOW_FIXTURES in tests/conftest.py names fixtures no test defines: {missing}"
