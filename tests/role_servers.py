"""The prefill/decode fleet tests' engines by role on loopback: each role's engine core behind a real uvicorn
server of the engine's own app (tests/helpers.py serve_in_thread), started and ready before the test sees its
URL, and the router's endpoint set over the prefill and decode ones. The servers stop, then the engine cores,
when the block ends. tests/fleet/test_disaggregation_http.py, test_epp_disaggregation.py and test_pd_traces.py
share it; each builds its own cores and server states (keys, traces, an aggregated oracle)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx
from helpers import serve_in_thread
from specfleet.router.endpoints import EndpointSet

STOP_TIMEOUT_S = 10  # each server thread's join: uvicorn's graceful shutdown is 2 s (serve_in_thread)


@contextmanager
def served_roles(states: Mapping[str, Any], engines: Mapping[str, Any]) -> Iterator[dict[str, str]]:
    """Each role's server state (engine/server/app.py build_state) served and ready: the base URLs by role.
    On exit the servers stop, then every one of `engines` (the states' engine core clients)."""
    from specfleet.engine.server.app import create_app

    servers, urls = [], {}
    try:
        for role, state in states.items():
            server, thread, urls[role] = serve_in_thread(create_app(state))
            servers.append((server, thread))
        for url in urls.values():
            assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
        yield urls
    finally:
        for server, _ in servers:
            server.should_exit = True
        for _, thread in servers:
            thread.join(STOP_TIMEOUT_S)
        for engine in engines.values():
            engine.stop()


def pd_endpoints(urls: Mapping[str, str]) -> EndpointSet:
    """The router's endpoints: the "prefill" and "decode" URLs, ready, in those roles."""
    endpoints = EndpointSet()
    for role in ("prefill", "decode"):
        endpoints.set_state(urls[role], ready=True, role=role)
    return endpoints
