"""The local fleet: an InferenceService's replicas as engine processes on loopback, the router in front
(specfleet.router, the same one the cluster runs), the tuner.

The fleet supervises its engines as a Deployment would: an engine that exits is taken out of routing at
once, logged with its exit code and last log lines, and restarted with backoff (engines.py). Readiness is
each engine's `/ready`. `scale_to` starts or retires engines (a retiring one drains: nothing new is
routed to it, and SIGTERM lets it finish what it has); it is the fleet's side of the tuner's `Scaler`
port (`queued`, `scale`), so the replica knob runs here as in the cluster and the simulator. Every start, a restart included, is on the tuner's
config in force (`LOG_DIR/live-config.json`, the engines' `--live-config-file`, written just before), and
its cold start (process start to first ready probe) is reported and kept in `startups`.

With `routing.mode: endpoint-picker` the router also serves as the endpoint picker (Envoy's ext_proc on
`ext_proc_port`, as the cluster's router pods do), and for prefill/decode roles behind it the fleet does what
the operator does with its `NAME-pd-key` Secret: a random key, in a file only this user reads in the log
folder, that the picker signs the prefill engine it names with and the decode engines check
(`--remote-prefill-key-file`, engine/kv_transfer/prefill_signature.py).

`LocalFleet` is the programmatic form (tests and `specfleet bench tune|route` use it); `local.main` is the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from specfleet.engine.kv_transfer.prefill_signature import KEY_FILE_FLAG
from specfleet.engine.ports import free_port
from specfleet.engine.python_child import python_command
from specfleet.operator.inference_service import InferenceService
from specfleet.operator.render.deployment import engine_args
from specfleet.router.adapters import AdapterTable
from specfleet.router.chat_template import ChatTemplate, add_engine_chat_flags
from specfleet.router.endpoints import EndpointSet
from specfleet.router.front import Front
from specfleet.router.kv_index import ExactPrefixIndex
from specfleet.router.kv_subscriber import KVEventFeeds, KVEventSubscriber
from specfleet.router.policies import PrefixAffinity, service_policy
from specfleet.router.prefix import BlockHasher, stable_hash
from specfleet.router.proxy import Router, serve
from specfleet.router.tracing import ENDPOINT_FLAG, RouterTracer, traces_endpoint
from specfleet.tuner.loop import ServiceTuner, Tick, build_tuner, replica_params
from specfleet.tuner.policy.replicas import ReplicaDecision, ReplicaPolicy

from .cores import CorePool
from .engines import EngineProcess, Startup, describe_exit

SUPERVISE_PERIOD_S = 0.2  # how soon an exited engine leaves routing (a poll of each process)
READY_PERIOD_S = 0.5  # how often each running engine's /ready is probed


def local_engine_command(
    isvc: InferenceService, port: int, extra: list[str] | None = None, admin_port: int | None = None
) -> list[str]:
    """The pod's engine command line, on loopback ports (the admin API on `admin_port`, or beside the API
    when None); the ceilings covering the tuner's bounds come with the pod's command line."""
    spec = isvc.spec
    for name, source in (
        ("model.source", spec.model.source),
        ("speculative.draftModel.source", (spec.speculative.draft_model or spec.model).source),
    ):
        if not source.startswith(("bundled://", "file://", "hf://")):
            raise ValueError(
                f"{name}={source!r} cannot run locally: use bundled://, file:///ABS/PATH or hf://"
            )
    draft = spec.speculative.draft_model.source if spec.speculative.draft_model else None
    args = engine_args(spec, spec.model.source, draft) + local_lora_modules(isvc)
    args[args.index("--port") + 1] = str(port)
    at = args.index("--admin-port")
    if admin_port is None:
        del args[at : at + 2]
    else:
        args[at + 1] = str(admin_port)
    if "--kv-cache-memory-fraction" in args and spec.resources.gpus == 0:
        at = args.index("--kv-cache-memory-fraction")
        del args[at : at + 2]
    args += ["--host", "127.0.0.1"]
    return python_command("-m", "specfleet.engine", *args, *(extra or []))


def local_lora_modules(isvc: InferenceService) -> list[str]:
    """spec.adapters as `--lora-modules name=path` (the engine loads them before it reports ready): local
    folders only (file:///ABS/PATH); a pvc:// or hf:// adapter is the cluster's to fetch."""
    modules = []
    for adapter in isvc.spec.adapters:
        if not adapter.source.startswith("file://"):
            raise ValueError(
                f"adapters[{adapter.name}].source={adapter.source!r} cannot run locally: use file:///ABS/PATH"
            )
        modules.append(f"{adapter.name}={adapter.source.removeprefix('file://')}")
    return ["--lora-modules", *modules] if modules else []  # one flag: it takes every value (nargs="+")


def local_tokenizer(source: str) -> Callable[[str], list[int]] | None:
    """The model's tokenizer for the router's token blocks, when the model is a local folder with a
    tokenizer.json (bundled:// after the engines converted it, file://); None: character blocks."""
    if not source.startswith(("bundled://", "file://")):
        return None
    try:
        from specfleet.engine.model_source import resolve_model
        from tokenizers import Tokenizer

        path = Path(resolve_model(source).path) / "tokenizer.json"
        if not path.exists():
            return None
        tokenizer = Tokenizer.from_file(str(path))
    except (ImportError, ValueError, OSError, RuntimeError):
        return None
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def local_chat_template(source: str, engine_args: list[str]) -> ChatTemplate | None:
    """The model's chat template beside that tokenizer, under the chat flags among the engines' arguments
    (--chat-template, ...), so that the router hashes chat requests as the engines render them
    (router/chat_template.py); None (chat on the estimate) without one."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_engine_chat_flags(parser)
    flags, _ = parser.parse_known_args(engine_args)
    try:
        from specfleet.engine.model_source import resolve_model

        return ChatTemplate.load(resolve_model(source).path, flags)
    except (ImportError, ValueError, OSError):
        return None


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
    policy: str | None = None  # None: spec.routing.policy (least-loaded with routing disabled)
    # each engine pinned to this many cores of its own (cores.py); None: every engine on every core
    cpus_per_engine: int | None = None
    say: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    # where the router's and the engines' spans go (engine/tracing.py traces_endpoint); None: no traces
    otlp_traces_endpoint: str | None = None
    # The engines' KV events (engine/kv_events.py): "publish" has every engine publish on sockets of its
    # own (ipc:// in the log folder: one host, so no shared port as in the cluster), "route" also has the
    # router subscribe and the prefix policy route on the exact index (router/kv_subscriber.py); "off":
    # neither. "publish" is the control of a comparison: the engines do the same work, the router estimates.
    # None: as the operator reads routing.kvEvents ("route" with the router and the prefix policy, the
    # default; "off" otherwise), and a model without a tokenizer.json the router can read then routes on
    # the estimate with a line saying so, where an explicit "route" is refused (`specfleet up --kv-events`).
    kv_events: Literal["off", "publish", "route"] | None = None
    # routing.mode endpoint-picker: the picker's ext_proc port (0: a free one; the cluster's is 9002)
    ext_proc_port: int = 0
    engines: list[EngineProcess] = field(default_factory=list)
    admin_urls: dict[str, str] = field(default_factory=dict)  # engine URL -> its admin API's URL (own port)
    ticks: list[Tick] = field(default_factory=list)

    def __post_init__(self) -> None:
        spec = self.isvc.spec
        routing = spec.routing
        self.router = Router(
            EndpointSet(),
            service_policy(routing.policy, routing.enabled, routing.load_factor_percent, self.policy),
            BlockHasher(spec.engine.block_size, None, stable_hash(spec.model.source)),
            session_header=routing.session_header or None,
            queue_timeout_s=float(routing.queue_timeout_seconds),
        )
        if spec.adapters:
            self.router.adapters = AdapterTable()
        if not self.otlp_traces_endpoint and spec.observability.otlp_traces_endpoint:
            # the YAML's collector, as the pods get it (the command line and OTEL_* take precedence)
            self.otlp_traces_endpoint = traces_endpoint(spec.observability.otlp_traces_endpoint)
        if self.otlp_traces_endpoint:
            self.router.tracer = RouterTracer.from_endpoint(self.otlp_traces_endpoint)
        self.tuner: ServiceTuner | None = None
        self.replica_policy: ReplicaPolicy | None = None
        self.replica_decisions: list[ReplicaDecision] = []
        self._cold_start: float | None = None
        self.cold_start_s: float | None = None
        self.startups: list[Startup] = []  # every engine start that reached /ready, in order
        if spec.autoscaling.enabled:
            self.replica_policy = ReplicaPolicy(replica_params(spec), self.isvc.desired_replicas)
            self.router.on_queue = self._on_queue
        self.cores = CorePool()
        if self.cpus_per_engine is not None:
            self.cores.check(self.cpus_per_engine)  # a count the machine lacks is refused before any start
        self._runner: Front | None = None  # the router's server (router/front.py)
        # its background work (supervision, probes, the tuner, each scale from zero): a task leaves the set
        # when it ends, so a long run that scales from zero often holds none that are done
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None
        self.log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix=f"specfleet-{self.isvc.name}-"))
        self._env = {**os.environ, "SPECFLEET_ADMIN_TOKEN": self.token, "TOKENIZERS_PARALLELISM": "false"}
        self._picker: Any = None  # the endpoint picker's gRPC server (routing.mode endpoint-picker)
        self.prefill_key: bytes | None = None  # the picker's and the decode engines' key (signs_prefill)
        self.prefill_key_file: Path | None = None
        if self.isvc.signs_prefill:
            self.prefill_key = secrets.token_urlsafe(32).encode()  # as the operator's Secret holds
            self.prefill_key_file = self.log_dir / "pd-key"
            fd = os.open(self.prefill_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(self.prefill_key)
        self.freeze_file = self.freeze_file or self.log_dir / "tuner-freeze"
        self.kv_event_addresses: dict[str, tuple[str, str | None]] = {}  # engine url -> (PUB, replay)
        self._kv_events_from_spec = self.kv_events is None
        if self.kv_events is None:  # the operator's routing.routes_on_kv_events, on the policy in force
            on = routing.enabled and routing.kv_events and isinstance(self.router.policy, PrefixAffinity)
            self.kv_events = "route" if on else "off"
        if self.kv_events not in ("off", "publish", "route"):
            raise ValueError(f"kv_events={self.kv_events!r} is not one of off, publish, route")
        if self.kv_events == "route" and not isinstance(self.router.policy, PrefixAffinity):
            raise ValueError(
                f"kv_events='route' needs the prefix policy (the one that reads an index), not "
                f"{self.router.policy.name!r}"
            )

    @property
    def live_config_file(self) -> Path:
        """The engines' `--live-config-file`: the tuner's config in force, rewritten before each start."""
        assert self.log_dir is not None  # set in __post_init__
        return self.log_dir / "live-config.json"

    def admin_url(self, engine_url: str) -> str:
        """Where one engine's admin API listens (the tuner's actuator maps engine URLs through this)."""
        return self.admin_urls.get(engine_url, engine_url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tuning(self) -> bool:
        return self.isvc.spec.autotune.enabled if self.tune is None else self.tune

    @property
    def engine_urls(self) -> list[str]:
        """Every engine that is not being retired, ready or not."""
        return [e.url for e in self.engines if not e.retiring]

    def ready_urls(self) -> list[str]:
        return [e.url for e in self.router.endpoints.routable()]

    # ---- engines -------------------------------------------------------------------------------------
    def _new_engine(self, role: str | None = None, cause: str = "start") -> EngineProcess:
        """`role`: "prefill" or "decode" with spec.disaggregation (the engine's --kv-role and its role in the
        router's endpoint set), None for an aggregated engine. The engines the tuner tunes (all but
        prefill's) start on its config in force (`--live-config-file`)."""
        index = max((e.index for e in self.engines), default=-1) + 1
        port, admin_port = free_port(), free_port()
        engine = EngineProcess(
            index,
            port,
            self.engine_command(index, port, admin_port, role),
            self._env,
            self.log_dir / f"engine-{index}.log",  # type: ignore[operator]
            role=role,
            cause=cause,
            cpus=self._take_cores(index),
        )
        self.admin_urls[engine.url] = f"http://127.0.0.1:{admin_port}"
        if self.kv_events != "off":  # where the router's subscription finds it (kv_events="route")
            self.kv_event_addresses[engine.url] = self._kv_event_sockets(index)
        self._start(engine)
        self.engines.append(engine)
        self.router.endpoints.set_state(engine.url, ready=False, draining=False, role=role)
        return engine

    def engine_command(self, index: int, port: int, admin_port: int, role: str | None = None) -> list[str]:
        """Engine `index`'s command line as the fleet starts it: the pod's on loopback ports, the fleet's
        flags, and unless kv_events is "off" its own KV event sockets (`--kv-events-config`)."""
        extra = self.engine_flags(role)
        if self.kv_events != "off":
            pub, replay = self._kv_event_sockets(index)
            events = {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay}
            extra.append(f"--kv-events-config={json.dumps(events)}")
        return local_engine_command(self.isvc, port, extra, admin_port=admin_port)

    def engine_flags(self, role: str | None) -> list[str]:
        """The flags the fleet adds to an engine of `role` beside the pod's command line (loopback ports and
        KV event sockets aside): its role, traces, the tuner's config in force, the picker's key."""
        extra = self.engine_extra_args + ([f"--kv-role={role}"] if role else [])
        if self.otlp_traces_endpoint:
            extra.append(f"{ENDPOINT_FLAG}={self.otlp_traces_endpoint}")
        if role != "prefill":
            extra.append(f"--live-config-file={self.live_config_file}")
        if role == "decode" and self.prefill_key_file is not None:  # honours the picker's signed header only
            extra.append(f"{KEY_FILE_FLAG}={self.prefill_key_file}")
        return extra

    def _kv_event_sockets(self, index: int) -> tuple[str, str]:
        """An engine's KV events PUB and replay sockets: ipc:// in the log folder (the engine binds them; a
        restart binds the same ones)."""
        assert self.log_dir is not None  # set in __post_init__
        return (
            f"ipc://{self.log_dir / f'engine-{index}-kv-pub.sock'}",
            f"ipc://{self.log_dir / f'engine-{index}-kv-replay.sock'}",
        )

    def _take_cores(self, index: int) -> frozenset[int] | None:
        if self.cpus_per_engine is None:
            return None
        cpus, exclusive = self.cores.take(self.cpus_per_engine)
        self.say(
            f"[fleet] engine {index} pinned to cores {','.join(map(str, sorted(cpus)))}"
            + ("" if exclusive else " (shared: every core is held by another engine)")
        )
        return cpus

    def _start(self, engine: EngineProcess) -> None:
        """Start (or restart) an engine's process on the tuner's config in force: the file its
        `--live-config-file` names is written first, so a new engine serves its first request tuned (none
        yet, or tuning off: no file, and the engine starts on the spec's values, its flags)."""
        settings = self.tuner.in_force if self.tuner is not None else None
        path = self.live_config_file
        if settings is None:
            path.unlink(missing_ok=True)
        else:
            staged = path.with_suffix(".tmp")  # renamed into place: an engine never reads half a file
            staged.write_text(json.dumps(settings.as_admin()))
            os.replace(staged, path)
        engine.start()

    def _set_routing(self, engine: EngineProcess, ready: bool, draining: bool = False) -> None:
        current = self.router.endpoints.get(engine.url)
        if current is not None and (current.ready, current.draining) == (ready, draining):
            return
        if ready and engine.ready_at is None:
            engine.ready_at = time.monotonic()
            startup = Startup(
                engine.index, engine.cause, engine.ready_at, engine.ready_at - engine.started_at
            )
            self.startups.append(startup)
            self.say(f"[fleet] engine {engine.index} ready {startup.seconds:.1f}s after its {engine.cause}")
        if ready and self._cold_start is not None:
            self.cold_start_s = time.monotonic() - self._cold_start
            self._cold_start = None
            self.say(
                f"[autoscaler] cold start: engine {engine.index} ready {self.cold_start_s:.1f}s after the "
                "first request queued"
            )
        self.router.endpoints.set_state(engine.url, ready=ready, draining=draining)
        self.router.endpoints_changed()

    async def start(self, ready_timeout_s: float | None = None) -> None:
        spec = self.isvc.spec
        disagg = spec.disaggregation
        if (
            disagg is not None
        ):  # its replicas replace spec.replicas; the replica knob scales the decode engines
            for _ in range(disagg.prefill.replicas):
                self._new_engine("prefill")
        replicas = (
            self.replica_policy.replicas
            if self.replica_policy is not None
            else spec.replicas
            if disagg is None
            else disagg.decode.replicas
        )
        for _ in range(replicas):
            self._new_engine(self._scaled_role)
        try:
            await self._wait_ready(ready_timeout_s or float(spec.engine.startup_timeout_seconds))
        except BaseException:  # a start that fails (or is cancelled) leaves no engine process behind
            for engine in self.engines:
                engine.kill()  # each engine's core exits with its server (engine/core/proc.py)
            raise
        encode = local_tokenizer(spec.model.source)
        if encode is not None:
            self.router.hasher = BlockHasher(spec.engine.block_size, encode, self.router.hasher.seed)
            engine_flags = [*spec.engine.extra_args, *self.engine_extra_args]
            self.router.chat_template = local_chat_template(spec.model.source, engine_flags)
        self._subscribe_kv_events()
        if self.tuning or self.replica_policy is not None:  # before the router serves: its queue scales
            self.tuner = self.new_tuner()
        # port 0 is bound as such and the kernel's choice read back: a port picked free beforehand can be
        # taken by another socket's ephemeral end before the router binds it (bench sim: EADDRINUSE)
        self._runner = await serve(self.router, self.host, self.port)
        self.port = self._runner.port
        if spec.routing.mode == "endpoint-picker":
            await self._serve_endpoint_picker()
        self.router.endpoints_changed()
        self._spawn(self._supervise())
        self._spawn(self._watch_ready())
        if self.tuner is not None:
            self._spawn(self._tune_forever())

    async def _serve_endpoint_picker(self) -> None:
        """The router's ext_proc server on `ext_proc_port` (grpc and Envoy's protos imported only here),
        signing with the fleet's key when the service has roles."""
        from specfleet.router.ext_proc_server import serve_endpoint_picker

        self._picker, self.ext_proc_port = await serve_endpoint_picker(
            self.router, self.host, self.ext_proc_port, self.prefill_key
        )
        signed = " (the prefill engine it names signed for the decode engines)" if self.prefill_key else ""
        self.say(f"[fleet] endpoint picker (Envoy ext_proc) on {self.host}:{self.ext_proc_port}{signed}")

    def _subscribe_kv_events(self) -> None:
        """The router's subscriber on every engine's own sockets, read by the prefix policy (an engine
        that published nothing yet is routed on the estimate meanwhile). Without the model's tokenizer the
        events cannot be read: an explicit "route" is refused, routing.kvEvents' default routes on the
        estimate (the engines publish to no one). Nothing unless kv_events is "route"."""
        if self.kv_events != "route":
            return
        if self.router.hasher.encode is None and self._kv_events_from_spec:
            self.say(
                f"[fleet] routing.kvEvents: {self.isvc.spec.model.source!r} has no tokenizer.json the router "
                "can read, so it routes on its estimate (routing.kvEvents: false stops the engines publishing)"
            )
            return
        if self.router.hasher.encode is None:
            for engine in self.engines:
                engine.kill()
            raise ValueError(
                f"kv_events='route' needs the model's tokenizer.json (the events name token blocks); "
                f"{self.isvc.spec.model.source!r} has none the router can read"
            )
        subscriber = KVEventSubscriber(ExactPrefixIndex(self.router.hasher.seed))
        assert isinstance(self.router.policy, PrefixAffinity)  # checked in __post_init__
        self.router.policy.exact = subscriber.match
        self.router.kv_feeds = KVEventFeeds(subscriber, addresses=self.kv_event_addresses)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def new_tuner(self) -> ServiceTuner:
        """A fresh tuner for this fleet: its ready engines, their admin ports, and the fleet as the replica
        knob's scaler when autoscaling is on."""

        async def ready() -> list[str]:
            return self.ready_urls()

        return build_tuner(
            self.isvc.name,
            self.isvc.spec,
            ready,
            self.token,
            admin_url=self.admin_url,
            prometheus_url=self.prometheus_url or "",
            prometheus_selector=self.prometheus_selector or f'job="{self.isvc.name}"',
            interval_s=self.interval_s,
            window_s=self.window_s,
            replicas=self.replica_policy,
            scaler=self if self.replica_policy is not None else None,
        )

    async def _probe(self, client: httpx.AsyncClient, url: str) -> bool:
        try:
            return (await client.get(f"{url}/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _wait_ready(self, timeout_s: float, engines: list[EngineProcess] | None = None) -> None:
        """At start an engine that exits is an error to report, not a crash loop to sit in."""
        engines = list(self.engines if engines is None else engines)
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                pending = [
                    e for e in engines if not getattr(self.router.endpoints.get(e.url), "ready", False)
                ]
                if not pending:
                    return
                for engine in pending:
                    if engine.proc is None or engine.proc.poll() is not None:
                        code = engine.proc.returncode if engine.proc is not None else None
                        raise RuntimeError(
                            f"engine {engine.index} ({engine.url}) exited with "
                            f"{describe_exit(code) if code is not None else 'no process'} while "
                            f"starting; last log lines:\n{engine.tail()}"
                        )
                    if await self._probe(client, engine.url):
                        self._set_routing(engine, ready=True)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"engines not ready after {timeout_s:.0f}s; see logs in {self.log_dir}"
                    )
                await asyncio.sleep(0.25)

    async def _supervise(self) -> None:
        """An engine that exits leaves routing at once; it is restarted after its backoff."""
        while True:
            now = time.monotonic()
            for engine in list(self.engines):
                code = engine.reap(now)
                if code is not None:
                    self._on_exit(engine, code)
                if engine.proc is None and engine.restart_at is not None and now >= engine.restart_at:
                    engine.restarts += 1
                    engine.cause = "restart"
                    self.say(
                        f"[fleet] restarting engine {engine.index} ({engine.url}), restart {engine.restarts}"
                    )
                    self._start(engine)
            await asyncio.sleep(SUPERVISE_PERIOD_S)

    def _on_exit(self, engine: EngineProcess, code: int) -> None:
        if engine.retiring:
            self.engines.remove(engine)
            self.router.endpoints.remove(engine.url)
            if engine.cpus is not None:
                self.cores.give_back(engine.cpus)
        else:
            self.router.endpoints.set_state(engine.url, ready=False, draining=False)
        if self.router.kv_feeds is not None:
            # its prefix cache and its event sequence are gone with it: the sync below subscribes afresh
            self.router.kv_feeds.subscriber.remove(engine.url)
        self.router.endpoints_changed([engine.url])  # its prefix cache is gone with it
        if engine.retiring:
            self.say(f"[fleet] engine {engine.index} ({engine.url}) stopped ({describe_exit(code)})")
            return
        delay = (engine.restart_at or time.monotonic()) - time.monotonic()
        self.say(
            f"[fleet] engine {engine.index} ({engine.url}) exited ({describe_exit(code)}) after "
            f"{time.monotonic() - engine.started_at:.0f}s; out of routing; restarting in {delay:.0f}s. "
            f"Last log lines ({engine.log_path}):\n{engine.tail()}"
        )

    async def _watch_ready(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                for engine in list(self.engines):
                    if engine.retiring or not engine.running:
                        continue
                    self._set_routing(engine, ready=await self._probe(client, engine.url))
                await asyncio.sleep(READY_PERIOD_S)

    # ---- replicas --------------------------------------------------------------------------------------
    @property
    def _scaled_role(self) -> str | None:
        """The role of the engines `replicas` counts: decode engines with disaggregation (prefill engines
        stay at spec.disaggregation.prefill.replicas)."""
        return None if self.isvc.spec.disaggregation is None else "decode"

    async def scale_to(self, replicas: int) -> None:
        """Start engines (they join routing once ready) or retire the newest (drained, then SIGTERM)."""
        if replicas < 0:
            raise ValueError(f"replicas={replicas} must be >= 0")
        active = [e for e in self.engines if not e.retiring and e.role != "prefill"]
        for _ in range(replicas - len(active)):
            engine = self._new_engine(self._scaled_role, "scale-up")
            self.say(f"[fleet] scaling up: started engine {engine.index} ({engine.url})")
        for engine in sorted(active, key=lambda e: e.index, reverse=True)[: max(0, len(active) - replicas)]:
            engine.retiring = True
            self._set_routing(engine, ready=False, draining=True)
            self.say(f"[fleet] scaling down: draining engine {engine.index} ({engine.url})")
            engine.terminate()  # the engine finishes its in-flight requests on SIGTERM, then exits

    # ---- tuner -----------------------------------------------------------------------------------------

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
        """One interval of the tuner (`ServiceTuner.interval`: the config, then the replica knob)."""
        assert self.tuner is not None, "tuning is off for this fleet"
        tick = await self.tuner.interval(self.frozen_by)
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
            except Exception as error:
                self.say(f"[tuner] interval failed: {type(error).__name__}: {error}")
            await asyncio.sleep(interval)

    def _on_queue(self, waiting: int) -> None:
        """The router holds a request with no engine ready: with zero replicas, start one now (not at the
        next tuner interval)."""
        if self.tuner is None or self.replica_policy is None or self.replica_policy.replicas > 0:
            return
        if self.router.stopping:
            return
        self._cold_start = time.monotonic()
        # `from_zero` decides before its first await (`waiting` is given): a second request queued before
        # this task runs finds one replica already asked for
        self._spawn(self._from_zero(self.tuner, waiting))

    @staticmethod
    async def _from_zero(tuner: ServiceTuner, waiting: int) -> None:
        await tuner.from_zero(waiting)

    # ---- the tuner's `Scaler` port ----------------------------------------------------------------------
    async def queued(self) -> int:
        """Requests the router holds while no engine is ready."""
        return self.router.queued

    async def scale(self, decision: ReplicaDecision) -> None:
        """A replica decision: kept (`replica_decisions`), said, and on a change run by `scale_to`."""
        if decision.notable:
            self.replica_decisions.append(decision)
            self.say(f"[autoscaler] {decision.kind}: {decision.reason}")
        if decision.changed:
            await self.scale_to(decision.replicas)

    async def stop(self, drain_timeout_s: float | None = None) -> list[int | None]:
        """Stop taking requests, SIGTERM the engines (they finish in-flight work), wait; exit codes."""
        self.router.stopping = self.router.draining = True  # /ready fails and new requests get 503
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in self.engines:
            self.router.endpoints.set_state(engine.url, ready=False, draining=True)
            engine.terminate()
        grace = (
            drain_timeout_s if drain_timeout_s is not None else self.isvc.spec.engine.drain_timeout_seconds
        ) + 10
        deadline = time.monotonic() + grace
        while any(e.running for e in self.engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        codes: list[int | None] = []
        for engine in self.engines:
            engine.kill()
            codes.append(
                engine.proc.returncode
                if engine.proc is not None
                else (engine.exit_codes[-1] if engine.exit_codes else None)
            )
        if self._runner is not None:
            await self._runner.cleanup()
        if self._picker is not None:
            await self._picker.stop(0)
        if self.tuner is not None:
            await self.tuner.close()
        if self.router.tracer is not None:
            self.router.tracer.shutdown()
        return codes
