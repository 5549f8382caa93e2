"""e2e against a real cluster (kind, k3d or any kubeconfig). Without one, everything skips with one line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import NAMESPACE, cluster_problem, kubectl


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problem = cluster_problem()
    if problem is None:
        return
    reason = f"e2e skipped: {problem}; see docs/operator.md (run e2e/run-kind.sh to create a kind cluster)"
    print(f"\n{reason}")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def namespace() -> Iterator[str]:
    kubectl("create", "namespace", NAMESPACE, check=False)
    yield NAMESPACE
    if os.environ.get("SPECFLEET_E2E_KEEP") != "1":
        kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
