"""A rolling update of the router under load drops nothing: two `specfleet router` processes behind a front
that plays their Service, streamed and plain requests sent without pause, each router replaced in turn
(the new one started and ready, then SIGTERM to the old one, which must exit 0), and every request answered
200 with every stream complete.

What the front models: a ClusterIP Service as kube-proxy implements it with endpoint readiness. It is an L4
proxy; each new client connection goes to the next ready router, round-robin; a connection already open
stays with its router until it closes (conntrack); a router leaves the ready set when its /ready fails
(the EndpointSlice's `ready: false`, seen by kube-proxy), polled every FRONT_POLL_SECONDS.
What it does not: the preStop sleep and the endpoint removal at pod deletion (here the router leaves only
through its own readiness, after SIGTERM: the later, harder order, which the shutdown delay covers), the
API server's and kube-proxy's propagation delays beyond the poll, several nodes, and the kubelet's SIGKILL.
The upstream is a light fake OpenAI engine on a real socket whose streams take STREAM_SECONDS: the router is
what is under test. Clients open a connection per request, as through a Service with no client pool; the
router's `Connection: close` after SIGTERM (test_shutdown.py) is what moves pooled clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from helpers import free_port
from specfleet.engine.python_child import python_command

pytestmark = pytest.mark.slow

CHUNKS = 8
CHUNK_SECONDS = 0.1
STREAM_SECONDS = CHUNKS * CHUNK_SECONDS  # each stream is in flight this long: SIGTERMs land mid-stream
FRONT_POLL_SECONDS = 0.1  # how soon the front sees a router's /ready fail
# After SIGTERM the router serves new requests this long, so none arrives after it refuses (a cluster's
# propagation takes seconds: the operator renders 2 s after a 5 s preStop sleep): 20 polls of the front. The
# front notices within a poll and a /ready round trip on a quiet host, but the routers and the front share a
# loaded runner's cores with engines, where 5 polls (0.5 s) were a few late wake-ups from a failed request.
SHUTDOWN_DELAY_SECONDS = 20 * FRONT_POLL_SECONDS
DRAIN_TIMEOUT_SECONDS = 10  # far above STREAM_SECONDS: every stream finishes well inside it
WORKERS = 6  # concurrent clients; half of their requests stream
# How long a router process may take to answer /ready: its start (Python, aiohttp, the router's imports)
# takes a few seconds on a quiet host and several times that on a loaded runner.
ROUTER_START_S = 60.0


async def fake_engine(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        await asyncio.sleep(0.02)
        return web.json_response({"choices": [{"text": "ok"}]})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for n in range(CHUNKS):
        await out.write(f"data: {json.dumps({'n': n})}\n\n".encode())
        await asyncio.sleep(CHUNK_SECONDS)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def start_engine() -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/ready", lambda _: web.json_response({"status": "ready"}))
    app.router.add_post("/v1/completions", fake_engine)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class RouterProcess:
    name: str
    engine: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RouterProcess:
        args = ["--endpoint", self.engine, "--port", str(self.port), "--host", "127.0.0.1"]
        args += ["--policy", "round-robin", "--log-level", "WARNING"]
        args += [
            "--shutdown-delay",
            str(SHUTDOWN_DELAY_SECONDS),
            "--drain-timeout",
            str(DRAIN_TIMEOUT_SECONDS),
        ]
        self.proc = subprocess.Popen(
            python_command("-m", "specfleet.router", *args), env=os.environ.copy(), stderr=subprocess.PIPE
        )
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Front:
    """The Service: see the module docstring."""

    routers: list[RouterProcess] = field(default_factory=list)
    ready: list[RouterProcess] = field(default_factory=list)
    # per connection: (router, opened, closed) in the loop's clock
    connections: list[tuple[str, float, float]] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    _next: int = 0

    async def poll(self, http: aiohttp.ClientSession) -> None:
        while True:
            ready = []
            for router in list(self.routers):
                try:
                    async with http.get(f"http://127.0.0.1:{router.port}/ready") as response:
                        if response.status == 200:
                            ready.append(router)
                except aiohttp.ClientError:
                    pass
            self.ready = ready
            await asyncio.sleep(FRONT_POLL_SECONDS)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        opened = loop.time()
        if not self.ready:  # no ready endpoint: kube-proxy rejects the connection
            writer.close()
            return
        router = self.ready[self._next % len(self.ready)]
        self._next += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", router.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                if dst.can_write_eof():
                    try:
                        dst.write_eof()
                    except OSError:
                        pass

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        up_writer.close()
        writer.close()
        self.connections.append((router.name, opened, loop.time()))


@dataclass
class Load:
    """Clients sending requests without pause, half streamed; every outcome that is not a complete 200 is a
    failure, named."""

    url: str
    ok: int = 0
    streams: int = 0
    failures: list[str] = field(default_factory=list)

    async def worker(self, index: int, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            stream = (index + n) % 2 == 0
            n += 1
            body = {
                "model": "m",
                "prompt": f"worker {index} request {n}",
                "max_tokens": CHUNKS,
                "stream": stream,
            }
            try:
                # a new connection per request (force_close): the Service picks a router for each
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                    async with http.post(f"{self.url}/v1/completions", json=body) as response:
                        text = await response.text()
                if response.status != 200:
                    self.failures.append(f"status {response.status}: {text[:200]}")
                elif stream and not (text.count("data: {") == CHUNKS and text.endswith("data: [DONE]\n\n")):
                    self.failures.append(f"incomplete stream: {text[-200:]!r}")
                else:
                    self.ok += 1
                    self.streams += stream
            except (aiohttp.ClientError, OSError, TimeoutError) as error:
                self.failures.append(f"{type(error).__name__}: {error}")


async def wait_until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_a_rolling_update_of_the_router_under_load_fails_no_request() -> None:
    async def scenario() -> None:
        engine, engine_url = await start_engine()
        front = Front()
        server = await asyncio.start_server(front.handle, "127.0.0.1", front.port)
        processes: list[RouterProcess] = []
        http = aiohttp.ClientSession()
        poller = asyncio.ensure_future(front.poll(http))
        load, stop = Load(f"http://127.0.0.1:{front.port}"), asyncio.Event()
        try:
            for name in ("a", "b"):
                processes.append(RouterProcess(name, engine_url).start())
                front.routers.append(processes[-1])
            await wait_until("both routers ready", lambda: len(front.ready) == 2, ROUTER_START_S)
            workers = [asyncio.ensure_future(load.worker(i, stop)) for i in range(WORKERS)]
            await asyncio.sleep(2 * STREAM_SECONDS)
            loop = asyncio.get_running_loop()
            terminated: dict[str, float] = {}
            # the Deployment's maxSurge 1 / maxUnavailable 0: the new pod first, then the old one goes
            for old, new in (("a", "a2"), ("b", "b2")):
                replacement = RouterProcess(new, engine_url).start()
                processes.append(replacement)
                front.routers.append(replacement)
                await wait_until(
                    f"router {new} ready", lambda r=replacement: r in front.ready, ROUTER_START_S
                )
                (leaving,) = [p for p in processes if p.name == old]
                assert leaving.proc is not None
                terminated[old] = loop.time()
                leaving.proc.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(loop.run_in_executor(None, leaving.proc.wait), 30)
                front.routers.remove(leaving)
                assert code == 0, leaving.proc.stderr.read().decode() if leaving.proc.stderr else code
                await asyncio.sleep(STREAM_SECONDS)  # load on the new pair before the next step
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), 30)
        finally:
            stop.set()
            poller.cancel()
            await http.close()
            server.close()
            for process in processes:
                process.stop()
            await engine.cleanup()

        assert load.failures == [], f"{len(load.failures)} failed of {load.ok + len(load.failures)}"
        assert load.ok > 50 and load.streams > 20, (load.ok, load.streams)
        # the drain was exercised: connections to each old router were open at its SIGTERM and ended after
        for old, at in terminated.items():
            across = [c for c in front.connections if c[0] == old and c[1] < at < c[2]]
            assert across, f"no request in flight on router {old} at its SIGTERM"

    asyncio.run(asyncio.wait_for(scenario(), 4 * ROUTER_START_S))  # three waits for starts, and the rest
