"""No import circles between modules: each folder's modules stand on each other in one direction, the shared
piece below both (attention/base.py below its backends, engine/errors.py below sampling parameters and
structured outputs, engine/checkpoint.py below the loader and the split model's workers, bench serve's
client below bench llamacpp). Function-level imports count: a circle through one is a circle at run time."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
PACKAGES = tuple(tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"])


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    circles = _circles(graph)
    details = []
    for group in circles:
        members = set(group)
        edges = [
            f"{a} -> {b} (line {', '.join(str(d['line_number']) for d in graph.get_import_details(importer=a, imported=b))})"
            for a in group
            for b in sorted(graph.find_modules_directly_imported_by(a) & members)
        ]
        details.append("\n  ".join(edges))
    assert not circles, "import circles; move the shared piece below both:\n  " + "\n\n  ".join(details)
