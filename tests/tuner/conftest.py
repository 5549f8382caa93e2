"""Fixtures with real parts: engine processes on the bundled model and a real Prometheus server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import free_port, stop_process, wait_http_ready

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
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    env = {**os.environ, "SPECFLEET_ADMIN_TOKEN": ADMIN_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specfleet.engine", *ENGINE_ARGS, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(f"{url}/ready", proc, log)
        yield url
    finally:
        stop_process(proc)
