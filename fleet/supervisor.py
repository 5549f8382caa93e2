"""The local fleet: an InferenceService's replicas as engine processes on loopback, one endpoint, the tuner.

`LocalFleet` is the programmatic form (tests and `specfleet bench tune` use it); `local.main` is the CLI.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from specfleet.operator.inference_service import InferenceService
from specfleet.operator.render.deployment import engine_args
from specfleet.tuner.actuator import AdminActuator
from specfleet.tuner.loop import ServiceTuner, Tick, params_from_spec, spec_config
from specfleet.tuner.policy import Policy
from specfleet.tuner.sources import PrometheusSource, ScrapeSource, Source

from .disaggregation import Roles
from .proxy import Backends, create_proxy


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_engine_command(isvc: InferenceService, port: int, extra: list[str] | None = None,
                         admin_port: int | None = None) -> list[str]:
    """The pod's engine command line, on loopback ports (the admin API on `admin_port`, or beside the API
    when None), with ceilings that cover the tuner's bounds."""
    spec = isvc.spec
    for name, source in (("model.source", spec.model.source),
                         ("speculative.draftModel.source", (spec.speculative.draft_model or spec.model).source)):
        if not source.startswith(("bundled://", "file://", "hf://")):
            raise ValueError(f"{name}={source!r} cannot run locally: use bundled://, file:///ABS/PATH or hf://")
    draft = spec.speculative.draft_model.source if spec.speculative.draft_model else None
    args = engine_args(spec, spec.model.source, draft)
    args[args.index("--port") + 1] = str(port)
    at = args.index("--admin-port")
    if admin_port is None:
        del args[at:at + 2]
    else:
        args[at + 1] = str(admin_port)
    if "--kv-cache-memory-fraction" in args and spec.resources.gpus == 0:
        at = args.index("--kv-cache-memory-fraction")
        del args[at:at + 2]
    bounds = spec.autotune.bounds
    args += ["--host", "127.0.0.1",
             "--max-num-seqs-limit", str(max(bounds.max_num_seqs[1], spec.batching.max_num_seqs)),
             "--max-num-batched-tokens-limit",
             str(max(bounds.max_num_batched_tokens[1], spec.batching.max_num_batched_tokens)),
             "--max-num-speculative-tokens",
             str(max(bounds.num_speculative_tokens[1], spec.speculative.num_speculative_tokens))]
    return [sys.executable, "-m", "specfleet.engine", *args, *(extra or [])]


@dataclass
class LocalFleet:
    isvc: InferenceService
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    prometheus_url: str | None = None
    prometheus_selector: str | None = None  # default job="<name>"
    tune: bool | None = None  # None: as spec.autotune.enabled says
    interval_s: float | None = None  # None: spec.autotune.intervalSeconds
    window_s: float | None = None
    engine_extra_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    on_tick: Callable[[Tick], None] | None = None
    freeze_file: Path | None = None  # while this file exists the tuner is frozen (None: LOG_DIR/tuner-freeze)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)
    admin_urls: dict[str, str] = field(default_factory=dict)  # engine URL -> its admin API's URL (own port)
    ticks: list[Tick] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.backends = Backends([])
        self.tuner: ServiceTuner | None = None
        self.roles: Roles | None = None
        self._server: uvicorn.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix=f"specfleet-{self.isvc.name}-"))
        self.freeze_file = self.freeze_file or self.log_dir / "tuner-freeze"

    def admin_url(self, engine_url: str) -> str:
        """Where one engine's admin API listens (the tuner's actuator maps engine URLs through this)."""
        return self.admin_urls.get(engine_url, engine_url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tuning(self) -> bool:
        return self.isvc.spec.autotune.enabled if self.tune is None else self.tune

    async def start(self, ready_timeout_s: float | None = None) -> None:
        spec = self.isvc.spec
        env = {**os.environ, "SPECFLEET_ADMIN_TOKEN": self.token, "TOKENIZERS_PARALLELISM": "false"}
        disagg = spec.disaggregation
        roles = ([None] * spec.replicas if disagg is None else
                 ["prefill"] * disagg.prefill.replicas + ["decode"] * disagg.decode.replicas)
        for i, role in enumerate(roles):
            port, admin_port = free_port(), free_port()
            log = open(self.log_dir / f"engine-{i}.log", "wb")  # noqa: SIM115 (closed with the process)
            extra = self.engine_extra_args + ([f"--kv-role={role}"] if role else [])
            command = local_engine_command(self.isvc, port, extra, admin_port=admin_port)
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
            self.engine_urls.append(f"http://127.0.0.1:{port}")
            self.admin_urls[self.engine_urls[-1]] = f"http://127.0.0.1:{admin_port}"
        self.backends.urls = [u for u, r in zip(self.engine_urls, roles, strict=True) if r != "prefill"]
        self.roles = None if disagg is None else Roles(
            [u for u, r in zip(self.engine_urls, roles, strict=True) if r == "prefill"], ready=self.backends.ready)
        await self._wait_ready(ready_timeout_s or float(spec.engine.startup_timeout_seconds))
        self.port = self.port or free_port(self.host)
        config = uvicorn.Config(create_proxy(self.backends, roles=self.roles), host=self.host, port=self.port, log_level="warning",
                                access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._tasks.append(asyncio.create_task(self._server.serve()))
        while not self._server.started:
            await asyncio.sleep(0.02)
        self._tasks.append(asyncio.create_task(self._watch_ready()))
        if self.tuning:
            self.tuner = self._build_tuner()
            self._tasks.append(asyncio.create_task(self._tune_forever()))

    def _build_tuner(self) -> ServiceTuner:
        spec = self.isvc.spec
        params = params_from_spec(spec, self.interval_s, self.window_s)

        async def ready() -> list[str]:
            return [u for u in self.engine_urls if u in self.backends.ready]

        source: Source
        if self.prometheus_url:
            selector = self.prometheus_selector or f'job="{self.isvc.name}"'
            source = PrometheusSource(self.prometheus_url, selector, params.window_s)
        else:
            source = ScrapeSource(ready, window_s=params.window_s)
        return ServiceTuner(self.isvc.name, Policy(params, spec_config(spec)), source, AdminActuator(self.token, admin_url=self.admin_url),
                            ready)

    async def _probe(self, client: httpx.AsyncClient, url: str) -> bool:
        try:
            return (await client.get(f"{url}/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while len(self.backends.ready) < len(self.engine_urls):
                for i, (proc, url) in enumerate(zip(self.processes, self.engine_urls, strict=True)):
                    if proc.poll() is not None:
                        tail = (self.log_dir / f"engine-{i}.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(f"engine {i} ({url}) exited with {proc.returncode} while starting:\n{tail}")
                    if await self._probe(client, url):
                        self.backends.ready.add(url)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engines not ready after {timeout_s:.0f}s; see logs in {self.log_dir}")
                await asyncio.sleep(0.25)

    async def _watch_ready(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                for url in self.engine_urls:
                    ok = await self._probe(client, url)
                    (self.backends.ready.add if ok else self.backends.ready.discard)(url)
                await asyncio.sleep(1.0)

    @property
    def frozen_by(self) -> str | None:
        """The local twin of the operator's freeze: spec.autotune.freeze in the YAML, or the freeze file
        (`touch` it to freeze, remove it to resume; read at every interval)."""
        if self.isvc.spec.autotune.freeze:
            return "spec.autotune.freeze"
        if self.freeze_file is not None and self.freeze_file.exists():
            return f"freeze file {self.freeze_file}"
        return None

    async def tick(self) -> Tick:
        assert self.tuner is not None, "tuning is off for this fleet"
        tick = await self.tuner.tick(self.frozen_by)
        self.ticks.append(tick)
        if self.on_tick is not None:
            self.on_tick(tick)
        return tick

    async def _tune_forever(self) -> None:
        assert self.tuner is not None
        interval = self.tuner.policy.params.interval_s
        while True:  # the first tick at once: the scrape source needs it as the base of its first window
            try:
                await self.tick()
            except Exception as error:  # noqa: BLE001 - the tuner must outlive one bad interval
                print(f"[tuner] interval failed: {type(error).__name__}: {error}", flush=True)
            await asyncio.sleep(interval)

    async def stop(self, drain_timeout_s: float | None = None) -> list[int | None]:
        """Stop taking requests, SIGTERM the engines (they finish in-flight work), wait; exit codes."""
        self.backends.draining = True
        for task in self._tasks[1:]:
            task.cancel()
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        grace = (drain_timeout_s if drain_timeout_s is not None else self.isvc.spec.engine.drain_timeout_seconds) + 10
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._tasks[0], return_exceptions=True)
        if self.tuner is not None:
            await self.tuner.close()
        return [p.returncode for p in self.processes]
