"""Fixtures with real parts: an engine process on the bundled model, and the Kubernetes API double."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One engine server process with the admin API on (n-gram speculation allowed, k starts at 0)."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    env = {"SPECFLEET_ADMIN_TOKEN": ADMIN_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    proc, url = start_server(log, *ENGINE_ARGS, env=env)
    try:
        yield url
    finally:
        stop_process(proc)


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
