from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_kube import FakeKube


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()
