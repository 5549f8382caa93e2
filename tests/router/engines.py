"""Stand-in engines for the router's tests: real aiohttp servers on loopback whose behaviour each test
sets (answer, stream, fail before or after the first byte, wait for a disconnect).

What they do not model: generation, the engine's prefix cache and metrics (tests/router/test_up_router.py
runs real engines for that); they only answer HTTP the way an engine can.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from specfleet.router.endpoints import EndpointSet
from specfleet.router.gateway import Gateway, serve_gateway
from specfleet.router.policies import make_policy
from specfleet.router.proxy import Router

if TYPE_CHECKING:
    from specfleet.router.tenant_gate import TenantGate

Behaviour = Callable[[web.Request, "FakeEngine"], Awaitable[web.StreamResponse]]


async def answer_ok(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    return web.json_response({"engine": engine.name, "path": request.path})


@dataclass
class FakeEngine:
    name: str
    behaviour: Behaviour = answer_ok
    requests: list[bytes] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeEngine:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.requests.append(await request.read())
            try:
                return await self.behaviour(request, self)
            except asyncio.CancelledError:  # the client (the router) dropped the connection
                self.disconnected.set()
                raise

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]  # the kernel's pick: no other socket can take it first
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()


async def stream_two_events(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    """SSE: one event, then (after the test releases it) a second and [DONE]."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"n": 1}\n\n')
    await engine.release.wait()
    await out.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
    await out.write_eof()
    return out


async def stream_forever(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    while True:
        await out.write(b'data: {"tick": 1}\n\n')
        await asyncio.sleep(0.05)


async def answer_503(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    return web.json_response({"error": {"message": "draining"}}, status=503, headers={"Retry-After": "5"})


async def break_after_first_byte(request: web.Request, engine: FakeEngine) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"n": 1}\n\n')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.close()  # the engine dies mid-stream
    return out


def engine_router(engine: FakeEngine) -> Router:
    """A service's router over one stand-in engine (round robin: the tests are not about the policy)."""
    return Router(EndpointSet([engine.url], ready=True), make_policy("round-robin"))


@asynccontextmanager
async def gateway_over(
    engine: FakeEngine, services: Iterable[tuple[str, int]], tenants: TenantGate | None = None
) -> AsyncIterator[str]:
    """A gateway on a port the kernel picks, over `engine`'s router: one service per (`NAMESPACE/NAME`,
    weight), served under NAME; its base URL while it serves. The engine is stopped with it."""
    gateway = Gateway(tenants=tenants)
    router = engine_router(engine)
    for key, weight in services:
        gateway.upsert(key, [key.split("/")[-1]], weight, router)
    gateway.synced = True
    front = await serve_gateway(gateway, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{front.port}"
    finally:
        await front.cleanup()
        await engine.stop()
