"""One loaded engine behind one real uvicorn server on a loopback port, shared by the server tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from helpers import serve_in_thread

ADMIN_TOKEN = "test-admin-token"
MODEL = "bundled://smollm2-135m-instruct"
# Small and fast: a short context and a small KV cache keep the shared engine cheap on 2 CPU cores.
ENGINE_KWARGS: dict[str, Any] = {
    "model": MODEL,
    "max_model_len": 1024,
    "kv_cache_gib": 0.25,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 1024,
    "speculative_method": "ngram",
    "num_speculative_tokens": 2,
}


@dataclass
class LiveServer:
    url: str
    state: Any  # ServerState
    app: Any

    @property
    def async_engine(self) -> Any:
        return self.state.async_engine

    @property
    def engine(self) -> Any:
        return self.state.engine

    def kv_blocks_in_use(self) -> int:
        return self.async_engine.call_sync("kv_blocks_in_use")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.async_engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.async_engine.num_in_flight == 0, (
            f"{self.async_engine.num_in_flight} requests still in flight"
        )


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    """The engine core in its own process, as `specfleet serve` runs it, and the client that talks to it."""
    from specfleet.engine import EngineConfig
    from specfleet.engine.core.client import EngineCoreClient

    client = EngineCoreClient(EngineConfig(**ENGINE_KWARGS), log_level="warning")
    yield client
    client.stop()


@pytest.fixture(scope="session")
def offline_engine() -> Any:
    """An in-process engine with the server's settings: the oracle a served request is compared with."""
    from specfleet.engine import Engine, EngineConfig

    return Engine(EngineConfig(**ENGINE_KWARGS))


@pytest.fixture(scope="session")
def serve_app() -> Any:
    """`serve_in_thread`, for a test that needs an app of its own."""
    return serve_in_thread


@pytest.fixture(scope="session")
def server(engine: Any) -> Iterator[LiveServer]:
    from specfleet.engine.server.app import build_state, create_app

    state = build_state(engine, admin_token=ADMIN_TOKEN, max_waiting=256)
    app = create_app(state)
    uv, thread, url = serve_in_thread(app)
    live = LiveServer(url, state, app)
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    yield live
    uv.should_exit = True
    thread.join(15)


@pytest.fixture(scope="session")
def client(server: LiveServer) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(server: LiveServer) -> str:
    return server.state.model_name
