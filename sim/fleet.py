"""The fleet over simulated time: arrivals, the router, the engines' steps and the tuner, as one event loop.

Events, in time order: a request arrives (the router's `least-loaded` policy, specfleet.router, least outstanding requests,
chooses its engine), an engine's step ends (the engine applies it and plans the next), the tuner's
interval (the real `ServiceTuner.tick`: its `ScrapeSource` reads the simulated engines' snapshots, the
real `Policy` decides, an actuator sets the engines' live settings as the admin API would). The proxy's
and the HTTP path's overhead is the profile's `request_overhead_s`, half on the way in, half on the way
out.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from specfleet.engine.knobs import LiveConfig
from specfleet.operator.inference_service import InferenceService
from specfleet.router.endpoints import EndpointSet
from specfleet.router.policies import LeastLoaded, RouteRequest
from specfleet.tuner.actuator import ApplyResult
from specfleet.tuner.loop import ServiceTuner, Tick, params_from_spec, spec_config
from specfleet.tuner.policy import Policy
from specfleet.tuner.snapshot import Snapshot
from specfleet.tuner.sources import ScrapeSource
from specfleet.tuner.types import LiveSettings, Observation

from .engine import Limits, Record, SimEngine
from .metrics import LogHistogram
from .profile import Profile
from .workload import SimRequest

ARRIVE, DELIVER, STEP, TICK = 0, 1, 2, 3  # same-time order: arrivals first, the tuner last


class SimActuator:
    """`AdminActuator.ensure` against simulated engines: unchanged, patched, or refused (past a ceiling)."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    async def ensure(self, urls: list[str], settings: Any) -> ApplyResult:
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
    ) -> None:
        spec = isvc.spec
        self.isvc = isvc
        self.profile = profile
        self.replicas = spec.replicas if replicas is None else replicas
        if self.replicas < 1:
            raise ValueError(f"replicas={self.replicas} must be >= 1 to simulate a fleet")
        self.tuning = spec.autotune.enabled if tune is None else tune
        self.now = 0.0
        self.itl = LogHistogram()
        self.sample_s = sample_s
        start = spec_config(spec)
        bounds = spec.autotune.bounds
        method = spec.speculative.method
        limits = Limits(
            max_model_len=spec.model.max_model_len,
            max_num_seqs=max(bounds.max_num_seqs[1], spec.batching.max_num_seqs),
            max_num_batched_tokens=max(
                bounds.max_num_batched_tokens[1], spec.batching.max_num_batched_tokens
            ),
            max_k=0
            if method == "none"
            else max(bounds.num_speculative_tokens[1], spec.speculative.num_speculative_tokens),
        )
        live = LiveConfig(
            num_speculative_tokens=start.num_speculative_tokens,
            max_num_seqs=start.max_num_seqs,
            max_num_batched_tokens=start.max_num_batched_tokens,
            speculative_disable_by_batch_size=spec.speculative.disable_by_batch_size
            if method != "none"
            else 0,
        )
        rng = random.Random(seed)
        self.engines = [
            SimEngine(
                i,
                profile,
                live,
                limits,
                block_size=spec.engine.block_size,
                prefix_caching=spec.engine.prefix_caching,
                rng=random.Random(rng.random()),
                accepted_per_pos=accepted_per_pos,
                fast=fast,
                keep_itls=keep_itls,
                itl_hist=self.itl,
            )
            for i in range(self.replicas)
        ]
        self.urls = [f"sim://engine-{i}" for i in range(self.replicas)]
        self.by_url = dict(zip(self.urls, self.engines))
        self.endpoints = EndpointSet(list(self.urls), ready=True)  # the router's, as `specfleet up` runs it
        self.routing = LeastLoaded()
        self.tuner: ServiceTuner | None = None
        if self.tuning:
            params = params_from_spec(spec, interval_s, window_s)
            self.tuner = ServiceTuner(
                isvc.name,
                Policy(params, start),
                SimSource(self, params.window_s),
                SimActuator(self),
                self.ready_urls,
            )

    async def ready_urls(self) -> list[str]:
        return [u for u in self.urls if self.endpoints.get(u) is not None and self.endpoints.get(u).routable]

    # -- the event loop --------------------------------------------------------------------------------------
    def run(self, requests: Iterable[SimRequest]) -> SimRun:
        wall, cpu = time.perf_counter(), time.process_time()
        loop = asyncio.new_event_loop()
        heap: list[tuple[float, int, int, Any, Any]] = []
        order = 0

        def push(t: float, kind: int, a: Any = None, b: Any = None) -> None:
            nonlocal order
            order += 1
            heapq.heappush(heap, (t, kind, order, a, b))

        source = iter(enumerate(requests))
        pending = next(source, None)
        if pending is not None:
            push(pending[1].arrival_s, ARRIVE, pending)
        interval = self.tuner.policy.params.interval_s if self.tuner else self.sample_s
        push(0.0, TICK)
        half = self.profile.request_overhead_s / 2
        records: list[Record] = []
        timeline: list[Timeline] = []
        ticks: list[Tick] = []
        in_flight = 0
        arrivals_since_tick = 0
        next_tick = 0.0
        first_arrival = pending[1].arrival_s if pending else 0.0
        # `EndpointSet.routable()` sorts every endpoint; its result changes only with the set's version (the
        # endpoints' in-flight counts are live in the same objects)
        routable, routable_version = self.endpoints.routable(), self.endpoints.version
        route = RouteRequest()

        def start(engine: SimEngine, t: float) -> None:
            nonlocal in_flight
            plan = engine.start_step(t, horizon=next_tick if self.tuner else float("inf"))
            if plan is not None:
                push(plan.end, STEP, engine.index, engine.version)
            for record in engine.take_done():
                self.endpoints.release(self.urls[record.engine])
                record.finish_s = (record.finish_s or t) + half
                if record.first_token_s is not None:
                    record.first_token_s += half
                records.append(record)
                in_flight -= 1

        while heap:
            t, kind, _, a, b = heapq.heappop(heap)
            self.now = t
            if kind == ARRIVE:
                index, request = a
                if routable_version != self.endpoints.version:  # the router's set, read again on a change
                    routable, routable_version = self.endpoints.routable(), self.endpoints.version
                choice = self.routing.choose(route, routable)
                assert choice is not None
                url = choice.url
                self.routing.routed(route, url)
                self.endpoints.acquire(url)
                engine = self.by_url[url]
                record = Record(
                    index, request.arrival_s, engine.index, request.prompt_tokens, request.output_tokens
                )
                push(t + half, DELIVER, (engine, request, record))
                in_flight += 1
                arrivals_since_tick += 1
                pending = next(source, None)
                if pending is not None:
                    if pending[1].arrival_s < t:
                        raise ValueError(
                            f"request {pending[0]} arrives at {pending[1].arrival_s}s, before the one "
                            f"ahead of it ({t}s): sort the trace by arrival_s"
                        )
                    push(pending[1].arrival_s, ARRIVE, pending)
            elif kind == DELIVER:
                engine, request, record = a
                if engine.cut(t):
                    push(engine.plan.end, STEP, engine.index, engine.version)
                engine.add(request, record, t)
                if engine.plan is None:
                    start(engine, t)
            elif kind == STEP:
                engine = self.engines[a]
                if b != engine.version or engine.plan is None:
                    continue  # a fast-mode run that an arrival cut short: its new end is queued
                engine.finish_step()
                start(engine, t)
            else:  # TICK
                for engine in self.engines:
                    if engine.cut(t):
                        push(engine.plan.end, STEP, engine.index, engine.version)
                entry = Timeline(
                    t,
                    self.replicas,
                    sum(len(e.scheduler.running) for e in self.engines),
                    sum(len(e.scheduler.waiting) for e in self.engines),
                    self.engines[0].live_config().as_dict(),
                    arrivals_per_s=arrivals_since_tick / interval if t > 0 else 0.0,
                )
                arrivals_since_tick = 0
                if self.tuner is not None:
                    tick = loop.run_until_complete(self.tuner.tick())
                    ticks.append(tick)
                    entry.kind, entry.reason = tick.decision.kind, tick.decision.reason
                    entry.tpot_p95_s, entry.ttft_p95_s = (
                        tick.observation.tpot_p95_s,
                        tick.observation.ttft_p95_s,
                    )
                    entry.config = self.engines[0].live_config().as_dict()
                timeline.append(entry)
                for engine in self.engines:  # settings take effect at the next step; an idle engine has none
                    if engine.plan is None and engine.scheduler.has_unfinished():
                        start(engine, t)
                if pending is not None or in_flight:
                    next_tick = t + interval
                    push(next_tick, TICK)
        if self.tuner is not None:
            loop.run_until_complete(self.tuner.close())
        loop.close()
        end = max((r.finish_s or 0.0 for r in records), default=first_arrival)
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
        return SimRun(
            records,
            timeline,
            ticks,
            end - first_arrival,
            time.perf_counter() - wall,
            self.replicas,
            sum(e.steps for e in self.engines),
            self.itl,
            unfinished=in_flight,
            decisions=decisions,
            cpu_s=time.process_time() - cpu,
        )
