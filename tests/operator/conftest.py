from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_kube import FakeKube, Rbac

# The namespace the operator tests use; the chart is rendered to watch it, so its Role is what the fake enforces.
NS = "team-a"


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    """The API double, enforcing the RBAC the Helm chart grants the operator in NS."""
    server = FakeKube(rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}})).start()
    yield server
    server.stop()
