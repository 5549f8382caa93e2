"""Fixtures with real parts: engine processes on the bundled model and a real Prometheus server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from specfleet.fleet.supervisor import free_port

ADMIN_TOKEN = "tuner-test-token-0123456789"
ENGINE_ARGS = ["--model", "bundled://smollm2-135m-instruct", "--max-model-len", "1024", "--kv-cache-gib", "0.25",
               "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--speculative-method", "ngram",
               "--num-speculative-tokens", "0", "--drain-timeout", "5", "--log-level", "warning"]


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"engine at {url} not ready after {timeout_s}s"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One engine server process with the admin API on (n-gram speculation allowed, k starts at 0)."""
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    env = {**os.environ, "SPECFLEET_ADMIN_TOKEN": ADMIN_TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specfleet.engine", *ENGINE_ARGS, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


