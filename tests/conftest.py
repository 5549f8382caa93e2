"""Shared fixtures: the bundled model's local folder, a tiny random-weight llama with the bundled tokenizer,
and a real Prometheus server on loopback."""

from __future__ import annotations

import os

# Every block the prefix cache registers is checked against the tokens its K/V was computed from.
os.environ.setdefault("SPECFLEET_KV_DEBUG", "1")
# The tests run engines, workers and clients side by side on a runner's few cores: OpenMP threads that
# spin at their barriers while the threads they wait for are descheduled make a step cost twice as much
# or worse there (docs/engine_core.md). Set before torch loads libgomp; the servers the tests start inherit
# it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest
from file_order import order_files
from helpers import (
    TOKENIZER_FILES,
    free_port,
    stop_process,
    tiny_config,
    wait_http_ready,
    write_tiny_checkpoint,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUNDLED = "bundled://smollm2-135m-instruct"

# The fast lane (`pytest -m "not slow"`) leaves out every test that asks, directly or through another fixture,
# for one of these: each starts a model engine (the tiny llama's or the bundled model's), a server, a
# Prometheus process or a real kopf operator over the API double (`kubeconfig`). pyproject.toml's `slow`
# marker describes the same rule; tests that start such things inline carry the mark by hand.
SLOW_FIXTURES = frozenset(
    {
        "tiny_llama",  # a model engine: every engine fixture (tiny, make_tiny, engines, fleet) builds on it
        "engine",  # the bundled model's engine core process (tests/server) or a module's own engine
        "offline_engine",
        "server",  # uvicorn over a socket in front of an engine
        "serve_app",
        "engines",  # tests/router: engine servers
        "engine_url",  # tests/tuner: an engine server
        "prometheus_factory",  # a real Prometheus process
        "kubeconfig",  # a real kopf operator (KopfRunner) against the API double over HTTP
        "replays",  # tests/operator/test_op_images: each Dockerfile's pip steps replayed into a fresh venv
    }
)


def pytest_configure(config: pytest.Config) -> None:
    # xdist's loadfile scheduler sorts the files by their number of tests unless told not to, which put the
    # longest files (one or two tests each) last; the order of the hook below is kept instead
    # (tests/file_order.py says how the scheduler hands out files).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The longest files first, so that CI's two workers end together (tests/file_order.py).
    order = order_files((item.nodeid, item.get_closest_marker("slow") is not None) for item in items)
    items[:] = [items[index] for index in order]


@pytest.fixture(scope="session")
def bundled_path():
    from specfleet.engine.model_source import resolve_model

    return resolve_model(BUNDLED).path


@pytest.fixture(scope="session")
def tiny_llama(bundled_path, tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer llama with random weights and the bundled tokenizer: an engine in a second, for tests of
    scheduling and semantics that do not need a model that writes well. Returns a `file://` URI."""
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-llama"),
        tiny_config("llama", max_position_embeddings=512, bos_token_id=1, eos_token_id=2),
        std=0.2,  # weights large enough that sampled and greedy tokens vary
        tokenizer_from=bundled_path,
        tokenizer_files=(*TOKENIZER_FILES, "chat_template.jinja"),
    )
    return f"file://{path}"


@pytest.fixture(scope="session")
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
            f"scrape_configs:\n  - job_name: {job}\n    static_configs: [{{targets: [{hosts}]}}]\n"
        )
        port = free_port()
        with open(workdir / "prometheus.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{url}/-/ready", proc, workdir / "prometheus.log", timeout=60, interval=0.2)
        return url

    yield start
    for proc in procs:
        stop_process(proc)
