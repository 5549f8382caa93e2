"""Two real engines for the gateway's tests (the tiny llama, each serving under a name of its own), started
once for the package: an engine costs seconds to start on a loaded runner."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import start_server, stop_process


@pytest.fixture(scope="package")
def engines(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two engines: served name -> URL."""
    logs = tmp_path_factory.mktemp("gateway-engines")
    started = {}
    try:
        for name in ("engine-a", "engine-b"):
            started[name] = start_server(
                logs / f"{name}.log",
                "--model",
                tiny_llama,
                "--served-model-name",
                name,
                "--max-model-len",
                "256",
                "--kv-cache-gib",
                "0.05",
            )
        yield {name: url for name, (_, url) in started.items()}
    finally:
        for proc, _ in started.values():
            stop_process(proc)
