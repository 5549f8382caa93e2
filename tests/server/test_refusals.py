"""Every request the engine turns away (429 queue_full, 503 draining, 503 not_ready) is counted in
`specfleet_requests_refused_total{reason}`, read back over HTTP from the real server's /metrics, and a
request the engine admits is not. The alert `SpecfleetEngineRefusingRequests` reads this counter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow


def refused(server: Any) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        m["reason"]: float(m["value"])
        for m in re.finditer(
            r'^specfleet_requests_refused_total\{[^}]*reason="(?P<reason>[a-z_]+)"[^}]*\} (?P<value>\S+)$',
            text,
            re.MULTILINE,
        )
    }


def post(server: Any, model_name: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model_name, "prompt": "Hi", "max_tokens": 1},
        timeout=60,
    )


@contextmanager
def setting(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def test_each_refusal_is_counted_once_under_its_reason(server: Any, model_name: str) -> None:
    before = refused(server)
    assert set(before) == {"queue_full", "draining", "not_ready"}, (
        before
    )  # every series from the first scrape

    with setting(server.async_engine, "max_waiting", 0):
        answers = [post(server, model_name) for _ in range(3)]
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(429, "queue_full")] * 3
    with setting(server.state, "draining", True):
        answers = [post(server, model_name) for _ in range(2)]
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(503, "draining")] * 2
    with setting(server.state, "ready", False):
        answer = post(server, model_name)
    assert (answer.status_code, answer.json()["error"]["code"]) == (503, "not_ready")
    assert post(server, model_name).status_code == 200  # admitted: not a refusal

    after = refused(server)
    assert {k: after[k] - before[k] for k in after} == {"queue_full": 3.0, "draining": 2.0, "not_ready": 1.0}
    server.wait_idle()


def test_an_unknown_refusal_reason_is_a_programming_error(server: Any) -> None:
    with pytest.raises(ValueError, match="not one of"):
        server.state.metrics.refuse("busy")
