"""The router's SIGTERM: the engine's termination sequence (engine/server/cli.py, DrainingServer), with the
same flags and meaning, so that a router pod restarting (an operator upgrade rolls it, a node drain evicts
it) drops no request:

1. SIGTERM: /ready fails at once, so the Service's endpoints drop the pod (the kubelet's preStop sleep has
   usually removed it already); new requests are still served for `--shutdown-delay` seconds (clients the
   Service routed before the removal); every response from now on closes its connection.
2. Then new requests get 503 with Retry-After; in-flight ones, streams included, run to their end within
   `--drain-timeout` seconds. The listener stays open, so a late client gets an answer, not a refused
   connection.
3. Then what is left is cut, the listener closes and the process exits 0. A second signal skips the waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

logger = logging.getLogger("specfleet.router")

# How often the drain looks at the in-flight count: small against any drain timeout, cheap on one loop.
POLL_SECONDS = 0.05


class Drainable(Protocol):
    """A router (proxy.Router) or a gateway over several (gateway.Gateway)."""

    stopping: bool
    draining: bool

    @property
    def in_flight(self) -> int: ...


async def drain(
    router: Drainable, shutdown_delay: float, drain_timeout: float, forced: asyncio.Event
) -> None:
    """Steps 1 and 2 above; returns when nothing is in flight, at the drain timeout, or when `forced`."""
    router.stopping = True
    if shutdown_delay > 0:
        logger.info("event=shutdown_delay seconds=%.1f", shutdown_delay)
        await _wait(forced, shutdown_delay)
    router.draining = True
    logger.info("event=drain_start in_flight=%d timeout_s=%.1f", router.in_flight, drain_timeout)
    deadline = time.monotonic() + drain_timeout
    while router.in_flight and not forced.is_set() and time.monotonic() < deadline:
        await _wait(forced, POLL_SECONDS)
    if router.in_flight:
        logger.warning("event=drain_timeout cut=%d forced=%s", router.in_flight, forced.is_set())
    logger.info("event=drain_done")


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except TimeoutError:
        pass
