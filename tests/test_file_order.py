"""The test files run longest first (tests/file_order.py): the order of the hook, and xdist told to keep it."""

from __future__ import annotations

from pathlib import Path

import pytest
from file_order import LONGEST_FILES, order_files

ROOT = Path(__file__).resolve().parent.parent


def test_the_longest_files_come_first_then_slow_files_then_the_rest_each_in_its_own_order() -> None:
    collected = [
        ("tests/a/test_fast.py::test_one", False),
        ("tests/a/test_fast.py::test_two", False),
        ("tests/b/test_two_slow.py::test_x[1]", True),
        ("tests/b/test_two_slow.py::test_plain", False),
        ("tests/b/test_two_slow.py::test_x[2]", True),
        ("tests/c/test_one_slow.py::TestClass::test_y", True),
        (f"{LONGEST_FILES[1]}::test_second_longest", True),
        (f"{LONGEST_FILES[0]}::test_longest", True),
        (f"{LONGEST_FILES[1]}::test_fast_beside_it", False),
        ("tests/test_last.py::test_z", False),
    ]
    order = [collected[i][0] for i in order_files(collected)]
    assert order == [
        f"{LONGEST_FILES[0]}::test_longest",
        f"{LONGEST_FILES[1]}::test_second_longest",
        f"{LONGEST_FILES[1]}::test_fast_beside_it",
        "tests/b/test_two_slow.py::test_x[1]",
        "tests/b/test_two_slow.py::test_plain",
        "tests/b/test_two_slow.py::test_x[2]",
        "tests/c/test_one_slow.py::TestClass::test_y",
        "tests/a/test_fast.py::test_one",
        "tests/a/test_fast.py::test_two",
        "tests/test_last.py::test_z",
    ]
    assert order_files([]) == []


def test_each_listed_file_exists() -> None:
    # a renamed or split file would fall out of the list without a word
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    missing = [name for name in LONGEST_FILES if not (ROOT / name).is_file()]
    assert not missing, f"tests/file_order.py lists files that do not exist: {missing}"


def test_xdist_keeps_the_collection_order(request: pytest.FixtureRequest) -> None:
    # tests/conftest.py's pytest_configure: without it, loadfile sorts the files by their number of tests
    assert request.config.getoption("loadscopereorder") is False
