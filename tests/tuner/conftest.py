"""Fixtures with real parts: engine processes on the bundled model and a real Prometheus server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from specfleet.operator.tuner.fleet import free_port

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


@pytest.fixture(scope="module")
def prometheus_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, list[str]], str]]:
    """Starts a real Prometheus scraping `targets` every second under `job`; returns its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is missing: apt-get install -y prometheus (.ci/setup installs it)")
    procs: list[subprocess.Popen[bytes]] = []

    def start(job: str, targets: list[str]) -> str:
        workdir = tmp_path_factory.mktemp("prometheus")
        hosts = ", ".join(f"'{t.removeprefix('http://')}'" for t in targets)
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs:\n  - job_name: {job}\n    static_configs: [{{targets: [{hosts}]}}]\n")
        port = free_port()
        with open(workdir / "prometheus.log", "wb") as log:
            proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={workdir / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                    stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not become ready"
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(20)
