"""Fixtures with real parts: an engine process on the bundled model, and the Kubernetes API double."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_kube import FakeKube, Rbac  # tests/ is on sys.path (rootdir conftest)
from helpers import start_server, stop_process

ADMIN_TOKEN = "tuner-test-token-0123456789"
ENGINE_ARGS = [
    "--model",
    "bundled://smollm2-135m-instruct",
    "--max-model-len",
    "1024",
    "--kv-cache-gib",
    "0.25",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "512",
    "--speculative-method",
    "ngram",
    "--num-speculative-tokens",
    "0",
    "--drain-timeout",
    "5",
    "--log-level",
    "warning",
]
_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="session")
def _tuner_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int]]]:
    """One engine server process for every tuner module (a start is ~10 s of a loaded runner's CPU), and
    the live settings it started on, as `GET /admin/config` answers them."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    env = {"SPECFLEET_ADMIN_TOKEN": ADMIN_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    proc, url = start_server(log, *ENGINE_ARGS, env=env)
    try:
        started_on = httpx.get(f"{url}/admin/config", headers=_AUTH, timeout=30)
        started_on.raise_for_status()
        yield url, started_on.json()
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def engine_url(_tuner_engine: tuple[str, dict[str, int]]) -> str:
    """The engine server with the admin API on (n-gram speculation allowed, k starts at 0), shared by the
    tuner's modules: each module gets it back on the settings it started on, as a fresh pod would be."""
    url, started_on = _tuner_engine
    httpx.patch(f"{url}/admin/config", json=started_on, headers=_AUTH, timeout=30).raise_for_status()
    assert httpx.get(f"{url}/admin/config", headers=_AUTH, timeout=30).json() == started_on
    return url


@pytest.fixture
def fake_kube(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeKube]:
    """The Kubernetes API double enforcing the chart's RBAC for one watched namespace, the test module's
    `NS`, with KUBECONFIG pointing at it (what the kopf tests run the operator against)."""
    ns: str = request.module.NS
    server = FakeKube(rbac=Rbac.from_chart({"watch": {"namespaces": [ns]}})).start()
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", ns)))
    server.add_namespace(ns)
    yield server
    server.stop()
