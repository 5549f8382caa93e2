"""The docs describe today: the parts' pages stay short enough to read, dated runs live in docs/results/, and
every decision record the code cites exists and is reachable from a page (docs/README.md, Decisions)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
DOCS = REPO / "docs"
# A page longer than this is a lab notebook again: its dated runs belong in docs/results/ (issue 35).
MAX_PAGE_LINES = 350
CITATION = re.compile(r"docs/decisions/(\d{3}-[a-z0-9-]+\.md)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
RESULT_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md")
DECISION_NAME = re.compile(r"\d{3}-[a-z0-9-]+\.md")


def source_files() -> list[Path]:
    """Every Python file of the project, tests included: hidden folders (venvs, caches) are not walked."""
    found = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        found.extend(Path(folder, name) for name in files if name.endswith(".py"))
    return found


def cited_in_code() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for path in source_files():
        for name in CITATION.findall(path.read_text(errors="replace")):
            cited.setdefault(name, []).append(str(path.relative_to(REPO)))
    return cited


def links(page: Path) -> list[Path]:
    return [
        (page.parent / target).resolve() for target in LINK.findall(page.read_text()) if "://" not in target
    ]


@pytest.mark.parametrize("page", ["tuner.md", "simulator.md"])
def test_a_parts_page_stays_under_its_line_budget(page: str) -> None:
    lines = len((DOCS / page).read_text().splitlines())
    assert lines < MAX_PAGE_LINES, (
        f"docs/{page} has {lines} lines, the limit is {MAX_PAGE_LINES}: move dated runs to "
        "docs/results/YYYY-MM-DD-<bench>.md and keep the page to how the part works today"
    )


def test_every_decision_record_the_code_cites_exists() -> None:
    cited = cited_in_code()
    assert cited, "no code cites a decision record (docs/decisions/NNN-name.md)"
    missing = {name: files for name, files in cited.items() if not (DOCS / "decisions" / name).is_file()}
    assert not missing, f"cited but not in docs/decisions/: {missing}"


def test_every_decision_record_is_cited_from_code_or_linked_from_a_page() -> None:
    """The index lists every record, so it does not count: a record no code cites and no page or result
    links to is a decision nobody reads where it applies."""
    records = sorted((DOCS / "decisions").glob("*.md"))
    assert records
    pages = [p for p in DOCS.rglob("*.md") if p.name != "README.md" and p.parent.name != "decisions"]
    linked = {target for page in pages for target in links(page)}
    cited = set(cited_in_code())
    orphans = [r.name for r in records if r.name not in cited and r.resolve() not in linked]
    assert not orphans, f"decision records neither cited from code nor linked from a page: {orphans}"


def test_the_index_lists_every_result_and_decision_and_every_link_resolves() -> None:
    index = DOCS / "README.md"
    indexed = set(links(index))
    for folder, pattern in (("results", RESULT_NAME), ("decisions", DECISION_NAME)):
        files = sorted((DOCS / folder).glob("*.md"))
        assert files, f"docs/{folder}/ is empty"
        for path in files:
            assert pattern.fullmatch(path.name), f"docs/{folder}/{path.name} does not match {pattern.pattern}"
            assert path.resolve() in indexed, f"docs/{folder}/{path.name} is not listed in docs/README.md"
    broken = [
        f"{page.relative_to(REPO)} -> {target}"
        for page in DOCS.rglob("*.md")
        for target in links(page)
        if not target.exists()
    ]
    assert not broken, f"links to files that do not exist: {broken}"
