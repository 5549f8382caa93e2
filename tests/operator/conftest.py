from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_kube import FakeKube, Rbac
from test_op_reconcile import NS  # the namespace the operator tests use: the chart's Role is rendered for it


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    """The API double, enforcing the RBAC the Helm chart grants the operator in NS."""
    server = FakeKube(rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}})).start()
    yield server
    server.stop()
