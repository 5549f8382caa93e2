"""The order the test files run in: the longest first, so that CI's two workers end together.

CI runs `pytest -q -n 2 --dist loadfile`: pytest-xdist's loadfile scheduler (xdist/scheduler/loadscope.py,
which loadfile.py subclasses) makes one work unit of each file and hands the units out in a queue, one more
to a worker whenever it has two or fewer tests left. Two things decide the queue's order:

- the collection order, which `pytest_collection_modifyitems` (tests/conftest.py) may change: the workers
  collect, run the hooks, and send their lists to the controller, whose queue follows them;
- `--loadscope-reorder`, on by default: before queueing, the scheduler sorts the units by their number of
  tests, most first (a stable sort: collection order only between files of one count). Several of our
  longest files hold one or two tests (the cold start, the operator at 200 services, priority scheduling
  through a server), so that sort put them last, where one of them ran alone while the other worker had finished: the tail. tests/conftest.py
  turns it off (`pytest_configure`), so the order here is the order the workers get.

The longest files go first (LONGEST_FILES, from CI's figures), then the other files that hold slow tests
(more slow tests first: a guess, where no figure is listed), then the rest in collection order; a file's
tests keep their order. The short files at the end fill in behind the long ones, so the workers end within a short
file of each other. The wall time of the longest file is a floor no order changes.
"""

from __future__ import annotations

from collections.abc import Iterable

# The files that ran longest in CI's last full run (pytest 1318 s on two workers, issue 35), longest first:
# their tests' `--durations` summed, scaled by what the changes of 2026-12-06 saved where they were measured
# alone (the cold start 214 -> 141 s, the operator at 200 services 82 -> 48 s; the Triton test, 107 -> 21 s,
# left the list). A file's place here only decides when it starts: a stale figure costs balance, never a
# result. tests/test_file_order.py checks that each of them exists.
LONGEST_FILES = (
    "tests/operator/test_op_images.py",  # 147 s +: three Dockerfile replays (pip into fresh venvs)
    "tests/engine/test_parallel.py",  # 115 s in its three longest tests, 20 more split engines
    "tests/fleet/test_cold_start.py",  # ~110 s (169 s before): one test, a cold start of four processes
    "tests/server/test_priority_http.py",  # 90 s: two tests, an engine each
    "tests/operator/test_op_api_calls.py",  # ~60 s (105 s before): one test, the operator at 200 services
    "tests/fleet/test_up_gateway.py",  # 46 s in two of its four tests
    "tests/fleet/test_supervision.py",  # 31 s in one of its two tests
)


def file_of(nodeid: str) -> str:
    """The file part of a node id: the scope xdist's loadfile scheduler groups by."""
    return nodeid.split("::", 1)[0]


def order_files(tests: Iterable[tuple[str, bool]]) -> list[int]:
    """The run order of `tests`, given as (node id, carries the slow mark) in collection order: indexes
    into that sequence, the longest files first (see the module docstring), each file's tests in order."""
    files: dict[str, list[int]] = {}
    slow: dict[str, int] = {}
    for index, (nodeid, is_slow) in enumerate(tests):
        name = file_of(nodeid)
        files.setdefault(name, []).append(index)
        slow[name] = slow.get(name, 0) + is_slow

    def rank(name: str) -> tuple[int, int]:
        if name in LONGEST_FILES:
            return (0, LONGEST_FILES.index(name))
        if slow[name]:
            return (1, -slow[name])
        return (2, 0)

    return [index for name in sorted(files, key=rank) for index in files[name]]
