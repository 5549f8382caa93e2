"""Test modules have unique file names across tests/ and e2e/: the test folders are not packages (pytest's
default `prepend` import mode), so two modules with one basename stop the whole collection with "import
file mismatch", and a new test file of a taken name breaks `pytest -q` for everyone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_test_module_name_is_unique() -> None:
    places: dict[str, list[str]] = defaultdict(list)
    for folder in ("tests", "e2e"):
        for path in (ROOT / folder).rglob("test_*.py"):
            if not (path.parent / "__init__.py").exists():
                places[path.name].append(str(path.relative_to(ROOT)))
    assert not {name: where for name, where in places.items() if len(where) > 1}
