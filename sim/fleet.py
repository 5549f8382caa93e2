"""The fleet over simulated time: arrivals, the router, the engines' steps and the tuner, as one event loop.

Events, in time order, each with its handler (`SimFleet._on_*`, dispatched by kind): a request arrives
(the router's policy from `spec.routing`, specfleet.router's own code, chooses its engine: prefix affinity
over the prompt's chained block hashes, least-loaded or round-robin), it reaches its engine, an engine's
step ends (the engine applies it and plans the next), a new replica is ready, the tuner's interval (the
real `ServiceTuner.interval`, as the operator and `specfleet up` run it: its `ScrapeSource` reads the
simulated engines' snapshots, the real `Policy` decides, an actuator sets the engines' live settings as
the admin API would, and with autoscaling the real replica policy decides through the fleet's side of the
`Scaler` port, `SimFleet.scale`). The proxy's and the HTTP path's overhead is the profile's
`request_overhead_s`, half on the way in, half on the way out.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from specfleet.engine.config import EngineConfig
from specfleet.engine.knobs import KNOBS, LiveConfig
from specfleet.engine.spec_decode.methods import method
from specfleet.operator.inference_service import InferenceService
from specfleet.operator.spec import InferenceServiceSpec
from specfleet.router.endpoints import EndpointSet
from specfleet.router.policies import RouteRequest, service_policy
from specfleet.router.prefix import chain_hashes, stable_hash, token_blocks
from specfleet.tuner.actuator import ApplyResult
from specfleet.tuner.loop import ServiceTuner, Tick, params_from_spec, replica_params, spec_config
from specfleet.tuner.policy import Policy
from specfleet.tuner.policy.replicas import ReplicaDecision, ReplicaPolicy
from specfleet.tuner.snapshot import Snapshot
from specfleet.tuner.sources import ScrapeSource
from specfleet.tuner.types import LiveSettings, Observation, TunedConfig

from .engine import Limits, Record, SimEngine
from .lora import SimAdapters
from .metrics import LogHistogram
from .profile import Profile
from .workload import SimRequest

ARRIVE, DELIVER, STEP, READY, TICK = 0, 1, 2, 3, 4  # same-time order: arrivals first, the tuner last


def _engine_args(
    spec: InferenceServiceSpec, accepted_per_pos: tuple[float, ...], fast: bool, keep_itls: bool, seed: int
) -> dict[str, Any]:
    """What each engine of a fleet is built with beside its profile, live settings, limits and generator."""
    return {
        "block_size": spec.engine.block_size,
        "prefix_caching": spec.engine.prefix_caching,
        "accepted_per_pos": accepted_per_pos,
        # the engine scores shadow drafts for the tuner while it verifies none (sim/shadow.py)
        "shadow": bool((m := method(spec.speculative.method)) and m.shadow_drafts),
        "fast": fast,
        "keep_itls": keep_itls,
        "draw_seed": seed,  # each request's speculation draws (sim/request_draws.py)
    }


class SimActuator:
    """`AdminActuator.ensure` against simulated engines: unchanged, patched, or refused (past a ceiling)."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    async def ensure(self, urls: list[str], settings: TunedConfig | LiveSettings) -> ApplyResult:
        if not isinstance(settings, LiveSettings):
            settings = LiveSettings(settings)
        result = ApplyResult(settings.config)
        body = settings.as_admin()
        for url in urls:
            engine = self.fleet.by_url[url]
            now = engine.live_config().as_dict()
            if all(now[k] == v for k, v in body.items()):
                result.unchanged.append(url)
                continue
            error = engine.update_config(**body)
            (result.refused.__setitem__(url, error) if error else result.patched.append(url))
        return result

    async def close(self) -> None:
        pass


class SimSource(ScrapeSource):
    """The direct-scrape source, its window arithmetic untouched, reading simulated engines at simulated time."""

    def __init__(self, fleet: SimFleet, window_s: float) -> None:
        super().__init__(fleet.ready_urls, window_s=window_s)
        self.fleet = fleet

    async def _scrape(self, url: str) -> Snapshot | None:
        return self.fleet.by_url[url].snapshot(self.fleet.now)

    async def observe(self) -> Observation:
        return replace(await super().observe(), time=self.fleet.now)


# An adapter's load (rank 16 on the bundled model): 261 ms, the median of the least loaded of three runs in
# docs/results/2026-12-03-lora-load.md (the host's load swung it to 470 ms); pass the engine's own
# specfleet_lora_adapter_load_seconds for another model.
LORA_LOAD_S = 0.26


def start_limits(spec: InferenceServiceSpec) -> Limits:
    """What a pod of `spec` starts with: its context length and each live knob's ceiling, derived as the
    engine derives them (`EngineConfig.<Knob.ceiling>`) from the flags the operator passes it (the start
    values and `ceiling_values`), so a knob added to the declaration is simulated with no change here."""
    draft = spec.speculative.draft_model
    flags: dict[str, Any] = {**spec.start_values(), **spec.ceiling_values()}
    config = EngineConfig(
        max_model_len=spec.model.max_model_len,
        speculative_method=spec.speculative.method,
        draft_model=draft.source if draft is not None else None,
        **flags,
    )
    ceilings = LiveConfig(**{knob.name: getattr(config, knob.ceiling) for knob in KNOBS})
    return Limits(spec.model.max_model_len, ceilings)


@dataclass
class Timeline:
    t: float
    replicas: int
    running: int
    waiting: int
    config: dict[str, int]
    kind: str = ""
    reason: str = ""
    tpot_p95_s: float | None = None
    ttft_p95_s: float | None = None
    arrivals_per_s: float = 0.0
    ready: int = 0  # replicas the router can send to (the rest are starting)
    queued: int = 0  # requests the router holds while no replica is ready


@dataclass
class SimRun:
    records: list[Record]
    timeline: list[Timeline]
    ticks: list[Tick]
    duration_s: float  # simulated, first arrival to last finish
    wall_s: float
    replicas: int
    steps: int
    itl: LogHistogram
    unfinished: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    cpu_s: float = 0.0  # the process's CPU time over the run: on a shared machine, steadier than wall time
    replica_seconds: float = 0.0  # every pod's life (start-up included) within the run's span
    max_replicas: int = 0
    replica_decisions: list[dict[str, Any]] = field(default_factory=list)
    rejected: int = 0  # answered 503: no replica ready within the router's queue timeout
    routing_policy: str = ""  # the router policy that chose every request's engine


class SimFleet:
    def __init__(
        self,
        isvc: InferenceService,
        profile: Profile,
        *,
        replicas: int | None = None,
        tune: bool | None = None,
        interval_s: float | None = None,
        window_s: float | None = None,
        fast: bool = False,
        seed: int = 0,
        keep_itls: bool = False,
        sample_s: float = 10.0,
        accepted_per_pos: tuple[float, ...] = (),
        autoscale: bool | None = None,
        startup_s: float | None = None,
        policy: str | None = None,
        lora_load_s: float = LORA_LOAD_S,
    ) -> None:
        spec = isvc.spec
        self.isvc = isvc
        self.profile = profile
        self.tuning = spec.autotune.enabled if tune is None else tune
        # replicas are the tuner's knob (spec validation: autoscaling needs autotune): no tuner, no autoscaler
        if autoscale and not self.tuning:
            raise ValueError("autoscaling needs the tuner: set spec.autotune.enabled or pass --tune")
        self.autoscaling = self.tuning and (spec.autoscaling.enabled if autoscale is None else autoscale)
        if replicas is None:
            replicas = isvc.desired_replicas if self.autoscaling else spec.replicas
        self.replicas = replicas  # at the start
        if self.replicas < (0 if self.autoscaling else 1):
            raise ValueError(
                f"replicas={self.replicas} must be >= 1 to simulate a fleet (0 only with autoscaling)"
            )
        self.startup_s = profile.startup_s if startup_s is None else startup_s
        if not self.startup_s >= 0:
            raise ValueError(f"startup_s={self.startup_s} must be >= 0 seconds")
        self.queue_timeout_s = float(spec.routing.queue_timeout_seconds)
        self.now = 0.0
        self.itl = LogHistogram()
        self.sample_s = sample_s
        self._limits = start_limits(spec)
        # what a pod's command line starts it with; the tuner brings a new pod to its config at its next tick
        self._live = LiveConfig(
            **spec.start_values(),
            speculative_disable_by_batch_size=spec.speculative.disable_by_batch_size
            if spec.speculative.method != "none"
            else 0,
        )
        self._rng = random.Random(seed)
        self.lora_load_s = lora_load_s  # each engine's own adapter cache (sim/lora.py), with spec.adapters
        self._engine_args = _engine_args(spec, accepted_per_pos, fast, keep_itls, seed)
        self.engines: list[SimEngine] = []
        self.urls: list[str] = []
        self.by_url: dict[str, SimEngine] = {}
        self.started_s: list[float] = []  # per engine: when its pod was created (cost counts from there)
        self.stopped_s: list[float | None] = []  # per engine: when it stopped (None: still running)
        self.retiring: set[int] = set()  # engines draining after a scale-down
        self.endpoints = EndpointSet()  # the router's, as `specfleet up` runs it
        for _ in range(self.replicas):
            self._add_engine(0.0, ready=True)
        routing = spec.routing  # as the operator renders the router (and `specfleet up` runs it)
        self.routing = service_policy(routing.policy, routing.enabled, routing.load_factor_percent, policy)
        # the router hashes a prompt's token blocks as the engine's prefix cache does, seeded by the model
        self._hash_seed = stable_hash(spec.model.source)
        self.replica_decisions: list[ReplicaDecision] = []
        self.queue: deque[tuple[float, int, SimRequest]] = deque()  # the router's: no engine is ready
        self.rejected = 0  # 503s: no engine ready within the router's queue timeout
        self.replica_policy = ReplicaPolicy(replica_params(spec), self.replicas) if self.autoscaling else None
        self.tuner = self._new_tuner(interval_s, window_s) if self.tuning else None
        self._run = _Run(self.interval_s)  # each `run` starts a fresh one
        self._aio: asyncio.AbstractEventLoop | None = None

    def _new_tuner(self, interval_s: float | None, window_s: float | None) -> ServiceTuner:
        """The real tuner on simulated engines: a scrape of their snapshots at simulated time, their live
        settings as the admin API sets them, the fleet as the replica knob's scaler, simulated time."""
        spec = self.isvc.spec
        params = params_from_spec(spec, interval_s, window_s)
        return ServiceTuner(
            self.isvc.name,
            Policy(params, spec_config(spec)),
            SimSource(self, params.window_s),
            SimActuator(self),
            self.ready_urls,
            replicas=self.replica_policy,
            scaler=self if self.replica_policy is not None else None,
            clock=lambda: self.now,
        )

    def _add_engine(self, t: float, ready: bool) -> SimEngine:
        index = len(self.engines)
        engine = SimEngine(
            index,
            self.profile,
            self._live,
            self._limits,
            rng=random.Random(self._rng.random()),
            itl_hist=self.itl,
            adapters=SimAdapters(self.isvc.spec.lora.max_loras, self.lora_load_s)
            if self.isvc.spec.adapters
            else None,
            **self._engine_args,
        )
        url = f"sim://engine-{index}"
        self.engines.append(engine)
        self.urls.append(url)
        self.by_url[url] = engine
        self.started_s.append(t)
        self.stopped_s.append(None)
        self.endpoints.set_state(url, ready=ready, draining=False)
        return engine

    @property
    def active(self) -> list[SimEngine]:
        """Engines that count as replicas: started (ready or not) and not retiring."""
        return [e for e in self.engines if self.stopped_s[e.index] is None and e.index not in self.retiring]

    async def ready_urls(self) -> list[str]:
        return [u for u in self.urls if (e := self.endpoints.get(u)) is not None and e.routable]

    # -- the tuner's `Scaler` port -----------------------------------------------------------------------
    async def queued(self) -> int:
        """Requests the router holds while no replica is ready."""
        return len(self.queue)

    async def scale(self, decision: ReplicaDecision) -> None:
        """As the local fleet's `scale_to`, at the simulated now: new engines join routing once started
        (`startup_s` later); the newest retire (drained, then stopped)."""
        if decision.notable:
            self.replica_decisions.append(decision)
        if not decision.changed:
            return
        t, active = self.now, self.active
        for _ in range(decision.replicas - len(active)):
            engine = self._add_engine(t, ready=False)
            self._run.starting += 1
            self._push(t + self.startup_s, READY, engine.index)
        for engine in sorted(active, key=lambda e: e.index, reverse=True)[
            : max(0, len(active) - decision.replicas)
        ]:
            self.retiring.add(engine.index)
            self.endpoints.set_state(self.urls[engine.index], ready=False, draining=True)
            if self._drained(engine):
                self._stop(engine, t)

    @property
    def interval_s(self) -> float:
        """Seconds between two ticks: the tuner's interval, or the timeline's sample period without one."""
        return self.tuner.policy.params.interval_s if self.tuner else self.sample_s

    # -- the event loop --------------------------------------------------------------------------------------
    def run(self, requests: Iterable[SimRequest]) -> SimRun:
        wall, cpu = time.perf_counter(), time.process_time()
        self._aio = asyncio.new_event_loop()
        r = self._run = _Run(
            source=iter(enumerate(requests)),
            interval=self.interval_s,
            half=self.profile.request_overhead_s / 2,
            hashed=self.routing.name == "prefix",  # the other policies never read the hashes
            routable=self.endpoints.routable(),
            routable_version=self.endpoints.version,
        )
        r.pending = next(r.source, None)
        if r.pending is not None:
            r.first_arrival = r.pending[1].arrival_s
            self._push(r.first_arrival, ARRIVE, r.pending)
        self._push(0.0, TICK)
        handlers = (self._on_arrive, self._on_deliver, self._on_step, self._on_ready, self._on_tick)
        heap = r.heap
        while heap:
            t, kind, _, a, b = heapq.heappop(heap)
            self.now = t
            handlers[kind](t, a, b)
        self.rejected += len(self.queue)  # still held at the end: no engine ever became ready
        self.queue.clear()
        if self.tuner is not None:
            self._aio.run_until_complete(self.tuner.close())
        self._aio.close()
        return self._result(time.perf_counter() - wall, time.process_time() - cpu)

    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        r = self._run
        r.order += 1
        heapq.heappush(r.heap, (t, kind, r.order, a, b))

    def _start(self, engine: SimEngine, t: float) -> None:
        """Plan the engine's next step (up to the next tuner interval: settings change there) and hand the
        requests it finished back to the router."""
        r = self._run
        plan = engine.start_step(t, horizon=r.next_tick if self.tuner else float("inf"))
        if plan is not None:
            self._push(plan.end, STEP, engine.index, engine.version)
        for record in engine.take_done():
            self.endpoints.release(self.urls[record.engine])
            record.finish_s = (record.finish_s or t) + r.half
            if record.first_token_s is not None:
                record.first_token_s += r.half
            r.records.append(record)
            r.in_flight -= 1
        if engine.index in self.retiring and self._drained(engine):
            self._stop(engine, t)  # the pod exits

    def _drained(self, engine: SimEngine) -> bool:
        """Nothing routed to it is left (delivered or on its way)."""
        endpoint = self.endpoints.get(self.urls[engine.index])
        return endpoint is None or endpoint.outstanding == 0

    def _stop(self, engine: SimEngine, t: float) -> None:
        self.retiring.discard(engine.index)
        self.stopped_s[engine.index] = t
        self.endpoints.remove(self.urls[engine.index])
        self.routing.forget(self.urls[engine.index])

    def _route(self, t: float, index: int, request: SimRequest) -> None:
        """The router: the policy's engine, else (no engine ready) held for scale from zero, or a 503."""
        r = self._run
        if r.routable_version != self.endpoints.version:  # the router's set, read again on a change
            r.routable, r.routable_version = self.endpoints.routable(), self.endpoints.version
        route = (
            RouteRequest(
                tuple(
                    chain_hashes(
                        token_blocks(request.prompt_ids(index), self._engine_args["block_size"]),
                        self._hash_seed,
                    )
                )
            )
            if r.hashed
            else RouteRequest()
        )
        choice = self.routing.choose(route, r.routable)
        if choice is None:
            if self.queue_timeout_s <= 0:
                self.rejected += 1
                return
            self.queue.append((t, index, request))
            if (
                self.tuner is not None
                and self.replica_policy is not None
                and self.replica_policy.replicas == 0
            ):
                assert self._aio is not None
                self._aio.run_until_complete(self.tuner.from_zero(len(self.queue)))
            return
        url = choice.url
        self.routing.routed(route, url)
        self.endpoints.acquire(url)
        engine = self.by_url[url]
        record = Record(index, request.arrival_s, engine.index, request.prompt_tokens, request.output_tokens)
        self._push(t + r.half, DELIVER, (engine, request, record))
        r.in_flight += 1

    def _on_arrive(self, t: float, a: Any, b: Any) -> None:
        r = self._run
        index, request = a
        self._route(t, index, request)
        r.arrivals_since_tick += 1
        r.pending = next(r.source, None)
        if r.pending is not None:
            if r.pending[1].arrival_s < t:
                raise ValueError(
                    f"request {r.pending[0]} arrives at {r.pending[1].arrival_s}s, before the one "
                    f"ahead of it ({t}s): sort the trace by arrival_s"
                )
            self._push(r.pending[1].arrival_s, ARRIVE, r.pending)

    def _on_deliver(self, t: float, a: Any, b: Any) -> None:
        engine, request, record = a
        if engine.cut(t):
            self._push(engine.plan.end, STEP, engine.index, engine.version)
        engine.add(request, record, t)
        if engine.plan is None:
            self._start(engine, t)

    def _on_step(self, t: float, a: Any, b: Any) -> None:
        engine = self.engines[a]
        if b != engine.version or engine.plan is None:
            return  # a fast-mode run that an arrival cut short: its new end is queued
        engine.finish_step()
        self._start(engine, t)

    def _on_ready(self, t: float, a: Any, b: Any) -> None:
        """A new pod loaded its model: routable; the router's queue drains to it."""
        self._run.starting -= 1
        if self.stopped_s[a] is not None or a in self.retiring:
            return  # scaled down again before it was ready
        self.endpoints.set_state(self.urls[a], ready=True, draining=False)
        held, self.queue = self.queue, deque()
        for queued_at, index, request in held:
            if t - queued_at > self.queue_timeout_s:
                self.rejected += 1
            else:
                self._route(t, index, request)

    def _on_tick(self, t: float, a: Any, b: Any) -> None:
        """The tuner's interval (config and replicas, `ServiceTuner.interval`) and the timeline's sample."""
        r = self._run
        for engine in self.engines:
            if engine.cut(t):
                assert engine.plan is not None, "cut() returns True only for a planned step"
                self._push(engine.plan.end, STEP, engine.index, engine.version)
        active = self.active
        entry = Timeline(
            t,
            len(active),
            sum(len(e.scheduler.running) for e in self.engines),
            sum(len(e.scheduler.waiting) for e in self.engines),
            (active[0].live_config() if active else self._live).as_dict(),
            arrivals_per_s=r.arrivals_since_tick / r.interval if t > 0 else 0.0,
            ready=len(self.endpoints.routable()),
            queued=len(self.queue),
        )
        r.arrivals_since_tick = 0
        if self.tuner is not None:
            assert self._aio is not None
            tick = self._aio.run_until_complete(self.tuner.interval())
            r.ticks.append(tick)
            self._sample(entry, tick, active)
        r.timeline.append(entry)
        for engine in self.engines:  # settings take effect at the next step; an idle engine has none
            if engine.plan is None and engine.scheduler.has_unfinished():
                self._start(engine, t)
        if r.pending is not None or r.in_flight or self.queue or r.starting:
            r.next_tick = t + r.interval
            self._push(r.next_tick, TICK)

    def _sample(self, entry: Timeline, tick: Tick, active: list[SimEngine]) -> None:
        """What the interval decided and saw, into its timeline entry."""
        entry.kind, entry.reason = tick.decision.kind, tick.decision.reason
        entry.tpot_p95_s, entry.ttft_p95_s = tick.observation.tpot_p95_s, tick.observation.ttft_p95_s
        if active:
            entry.config = active[0].live_config().as_dict()
        decision = tick.replicas
        if decision is not None:
            entry.replicas, entry.ready = len(self.active), len(self.endpoints.routable())
            if decision.notable:
                entry.reason = f"{entry.reason}; replicas: {decision.reason}"

    def _result(self, wall_s: float, cpu_s: float) -> SimRun:
        r = self._run
        records, timeline, ticks = r.records, r.timeline, r.ticks
        end = max((rec.finish_s or 0.0 for rec in records), default=r.first_arrival)
        decisions = [
            {
                "t": round(k.decision.time, 3),
                "kind": k.decision.kind,
                "reason": k.decision.reason,
                "config": k.decision.config.short() if k.decision.config else None,
            }
            for k in ticks
            if k.decision.changed
        ]
        span = (r.first_arrival, end)
        lives = [
            max(0.0, min(stopped if stopped is not None else end, span[1]) - max(started, span[0]))
            for started, stopped in zip(self.started_s, self.stopped_s)
        ]
        return SimRun(
            records,
            timeline,
            ticks,
            end - r.first_arrival,
            wall_s,
            self.replicas,
            sum(e.steps for e in self.engines),
            self.itl,
            unfinished=r.in_flight,
            decisions=decisions,
            cpu_s=cpu_s,
            replica_seconds=sum(lives),
            max_replicas=max([self.replicas, *(entry.replicas for entry in timeline)]),
            replica_decisions=[
                {"t": round(d.time, 3), "kind": d.kind, "replicas": d.replicas, "reason": d.reason}
                for d in self.replica_decisions
                if d.changed
            ],
            rejected=self.rejected,
            routing_policy=self.routing.name,
        )


@dataclass
class _Run:
    """The event loop's state over one `SimFleet.run`."""

    interval: float  # seconds between two ticks (`SimFleet.interval_s`)
    heap: list[tuple[float, int, int, Any, Any]] = field(default_factory=list)
    order: int = 0  # ties at one time and kind pop in push order
    source: Iterator[tuple[int, SimRequest]] = field(default_factory=lambda: iter(()))
    pending: tuple[int, SimRequest] | None = None  # the next arrival, pushed; the rest wait in `source`
    first_arrival: float = 0.0
    half: float = 0.0  # half the profile's request overhead: on the way in, and on the way out
    hashed: bool = False
    # `EndpointSet.routable()` sorts every endpoint; its result changes only with the set's version (the
    # endpoints' in-flight counts are live in the same objects)
    routable: list[Any] = field(default_factory=list)
    routable_version: int = -1
    records: list[Record] = field(default_factory=list)
    timeline: list[Timeline] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    in_flight: int = 0
    arrivals_since_tick: int = 0
    next_tick: float = 0.0
    starting: int = 0  # engines created and not yet ready
