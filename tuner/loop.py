"""One tuning loop for one service: observe, decide, actuate. The operator, the local fleet and the
simulator share it.

`interval()` is the whole of one interval of joint tuning, the same in every host: tell the config policy
whether the replica knob can still add capacity (`Policy.replica_room`), run the config's `tick()`, decide
the replica count from the same observation and goodput model, and hand that decision to the host's
`Scaler`. `from_zero()` is the one step between intervals: with zero replicas, a request the routers hold
brings the first one at once. `tick()` alone reads the source, lets the policy decide, then makes every
ready engine run the policy's config (a restarted pod is brought back to it), and reports what happened. `in_force` is the
config engines accepted last: what a new engine starts on (`specfleet up` writes it to the engines'
`--live-config-file`, the operator's timer to the `NAME-tuned` ConfigMap the pods mount), so a pod of a
scale-up or a restart serves its first request tuned; `sync_new_pods` is the check behind it. Frozen (`frozen_by`:
spec.autotune.freeze, the annotation, `specfleet up`'s freeze file), it only observes: no decision, no push,
so a config someone sets by hand during an incident stays. It also reports the transitions an SRE wants to
see as Events: frozen / resumed, and failing static (metrics missing) / recovered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specfleet.operator.spec import InferenceServiceSpec

from .actuator import Actuator, AdminActuator, ApplyResult
from .policy import Policy, PolicyParams
from .policy.replicas import ReplicaDecision, ReplicaParams, ReplicaPolicy
from .sources import Endpoints, PrometheusSource, ScrapeSource, Source
from .types import SLO, Decision, LiveSettings, Observation, TuneBounds, TunedConfig

logger = logging.getLogger("specfleet.tuner")


def params_from_spec(
    spec: InferenceServiceSpec, interval_s: float | None = None, window_s: float | None = None
) -> PolicyParams:
    """Policy settings from an InferenceService spec: SLO, bounds (k pinned to 0 without a method)."""
    interval = float(interval_s if interval_s is not None else spec.autotune.interval_seconds)
    return PolicyParams(
        slo=SLO(spec.slo.ttft_p95_ms / 1000.0, spec.slo.tpot_p95_ms / 1000.0),
        bounds=TuneBounds(**spec.tuned_bounds()),
        interval_s=interval,
        window_s=float(window_s if window_s is not None else max(interval, 10.0)),
    )


def replica_params(spec: InferenceServiceSpec) -> ReplicaParams:
    """The replica knob's settings from `spec.autoscaling` (the cluster's and `specfleet up`'s alike)."""
    a = spec.autoscaling
    return ReplicaParams(
        a.min_replicas,
        a.max_replicas,
        float(a.scale_up_stabilization_seconds),
        float(a.scale_down_stabilization_seconds),
        float(a.cooldown_seconds),
    )


# Spec fields that change neither what the tuner learned nor its settings: scaling (every /scale write bumps
# metadata.generation), how pods roll and where they run.
INDEPENDENT_FIELDS = frozenset({"replicas", "rollout", "pod", "scheduling", "routing", "autoscaling"})


def tuner_fingerprint(spec: InferenceServiceSpec) -> str:
    """A hash of the spec fields the tuner depends on: its policy is rebuilt only when this changes."""
    # autotune.freeze too: a frozen tuner holds its config and keeps what it learned (checked every tick)
    relevant = spec.model_dump(
        mode="json", by_alias=True, exclude={**{f: True for f in INDEPENDENT_FIELDS}, "autotune": {"freeze"}}
    )
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def spec_config(spec: InferenceServiceSpec) -> TunedConfig:
    """The config a pod starts with (what the engine's command line says)."""
    return TunedConfig(**spec.start_values())


def build_tuner(
    name: str,
    spec: InferenceServiceSpec,
    endpoints: Endpoints,
    admin_token: str,
    *,
    admin_url: Callable[[str], str] = lambda url: url,
    prometheus_url: str = "",
    prometheus_selector: str = "",
    interval_s: float | None = None,
    window_s: float | None = None,
    replicas: ReplicaPolicy | None = None,
    scaler: Scaler | None = None,
) -> ServiceTuner:
    """The one wiring of a service's tuner, shared by the operator's timer and the local fleet: the policy
    from the spec, metrics from Prometheus when a URL is given (else a direct scrape of `endpoints`), and
    the admin API of the same endpoints (`admin_url` maps one to its admin address) with the service's
    admin token; with autoscaling, the replica policy and the host's scaler."""
    params = params_from_spec(spec, interval_s, window_s)
    source: Source = (
        PrometheusSource(prometheus_url, prometheus_selector, params.window_s)
        if prometheus_url
        else ScrapeSource(endpoints, window_s=params.window_s)
    )
    return ServiceTuner(
        name,
        Policy(params, spec_config(spec)),
        source,
        AdminActuator(admin_token, admin_url=admin_url),
        endpoints,
        replicas=replicas,
        scaler=scaler,
    )


@dataclass
class Tick:
    decision: Decision
    observation: Observation
    applied: ApplyResult | None
    guard: int | None = None  # the engines' speculative_disable_by_batch_size (None: not managed)
    frozen_by: str | None = None  # who froze the tuner for this interval (None: tuning)
    transitions: tuple[str, ...] = ()  # of TRANSITIONS, entered at this interval
    replicas: ReplicaDecision | None = None  # the replica knob's decision at this interval (None: not on)
    slo: SLO | None = None  # the targets the decision read goodput against (status reads adapters' by it)


# What a tick can enter, in the order they are reported.
TRANSITIONS = ("frozen", "resumed", "static", "recovered")


class Scaler(Protocol):
    """The replica knob's port: how one host reads its routers' queue and acts on a replica decision. The
    operator writes `status.autoscaling` (its reconcile renders the count into the Deployment: a `/scale`
    of its own), `specfleet up` starts or retires engine processes (`LocalFleet.scale_to`), the simulator
    its simulated engines (`SimFleet.scale`). What to decide, and when, is `ServiceTuner`'s alone."""

    async def queued(self) -> int:
        """Requests the service's routers hold while no engine is ready."""
        ...

    async def scale(self, decision: ReplicaDecision) -> None:
        """Act on one decision (a hold too: a host may report it); on a change, run `decision.replicas`."""
        ...


class ServiceTuner:
    def __init__(
        self,
        name: str,
        policy: Policy,
        source: Source,
        actuator: Actuator,
        endpoints: Endpoints,
        *,
        replicas: ReplicaPolicy | None = None,
        scaler: Scaler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.policy = policy
        self.source = source
        self.actuator = actuator
        self.endpoints = endpoints
        # The replica knob beside the config (None: autoscaling off); the host sets both, and the operator
        # sets them again at every tick (its replica policy outlives a tuner rebuilt by a spec change).
        self.replicas = replicas
        self.scaler = scaler
        self.clock = clock  # the replica policy's time (the simulator's is simulated), the host's intervals
        self.synced: set[str] = set()  # engines that ran the policy's config at the last push
        # the settings engines accepted at the last push that reached one: what a new engine starts on
        self.in_force: LiveSettings | None = None
        self.frozen_by: str | None = None  # as of the last tick; set from status when the loop is rebuilt
        self.static = False  # whether the last tick failed static (metrics missing)
        self.static_intervals = 0  # consecutive ticks that failed static

    def _accepted(self, applied: ApplyResult, settings: LiveSettings) -> None:
        if applied.patched or applied.unchanged:
            self.in_force = settings

    async def sync_new_pods(self) -> ApplyResult | None:
        """Between intervals: push the config in force to ready engines not seen at the last push. A new
        engine already starts on `in_force` (its live-config file); this brings one that could not (its
        file was written after it started, or it was started by hand) to it within a timer tick."""
        desired = self.policy.current
        if desired is None or self.frozen_by is not None:  # frozen: the tuner touches no pod
            return None
        urls = await self.endpoints()
        new = [u for u in urls if u not in self.synced]
        if not new:
            return None
        guard = self.policy.guard if self.policy.manages_guard else None
        settings = LiveSettings(desired, guard)
        applied = await self.actuator.ensure(new, settings)
        self.synced.update(applied.unchanged + applied.patched)
        self._accepted(applied, settings)
        return applied

    async def tick(self, frozen_by: str | None = None) -> Tick:
        obs = await self.source.observe()
        was_frozen, self.frozen_by = self.frozen_by, frozen_by or None
        if self.frozen_by is not None:
            decision = self.policy.freeze(obs, self.frozen_by)
            if was_frozen is None:
                logger.info("event=tuner_frozen service=%s by=%r", self.name, self.frozen_by)
            entered = () if was_frozen else ("frozen",)
            return Tick(decision, obs, None, None, self.frozen_by, entered, slo=self.policy.params.slo)
        transitions = ["resumed"] if was_frozen else []
        decision = self.policy.decide(obs)
        if decision.kind == "missing" and not await self.endpoints():
            decision = self.policy.no_engine(obs.time)  # scaled to zero or starting: nothing to observe
        applied = None
        desired = self.policy.current
        guard = self.policy.guard if self.policy.manages_guard else None
        if desired is not None:
            urls = await self.endpoints()
            settings = LiveSettings(desired, guard)
            applied = await self.actuator.ensure(urls, settings)
            if applied.refused:
                message = next(iter(applied.refused.values()))
                decision = self.policy.rejected(obs.time, desired, message)
                if decision.config is not None:
                    settings = LiveSettings(decision.config, guard)
                    applied = await self.actuator.ensure(urls, settings)
            self.synced = set(applied.unchanged + applied.patched)
            self._accepted(applied, settings)
            if applied.failed:
                logger.warning(
                    "event=tuner_apply_failed service=%s %s",
                    self.name,
                    " ".join(f"{u}={e!r}" for u, e in applied.failed.items()),
                )
        if decision.changed:
            logger.info(
                "event=tuner_decision service=%s kind=%s reason=%r", self.name, decision.kind, decision.reason
            )
        static = decision.kind == "missing"
        self.static_intervals = self.static_intervals + 1 if static else 0
        if static != self.static:
            transitions.append("static" if static else "recovered")
            self.static = static
        return Tick(decision, obs, applied, guard, None, tuple(transitions), slo=self.policy.params.slo)

    async def interval(self, frozen_by: str | None = None) -> Tick:
        """One interval of joint tuning. While the replica knob can still add capacity, a TPOT over target
        is its to fix (the config search keeps max_num_seqs at the requests per engine); the replica count
        is then decided from the tick's observation and the policy's goodput model, so both knobs read one
        model, and the host's scaler acts on it."""
        replicas, scaler = self.replicas, self.scaler
        self.policy.replica_room = replicas is not None and scaler is not None and replicas.room
        tick = await self.tick(frozen_by)
        if replicas is None or scaler is None:
            return tick
        obs = tick.observation
        tick.replicas = replicas.decide(
            self.clock(),
            obs,
            None if obs.error else self.policy.model(obs),
            self.policy.current,
            self.policy.params.slo,
            await scaler.queued(),
        )
        await scaler.scale(tick.replicas)
        return tick

    async def from_zero(self, queued: int | None = None) -> ReplicaDecision | None:
        """Between intervals: with zero replicas and a request held by the routers (`queued`, else the
        scaler's count), one replica now rather than at the next interval. None when there is nothing to
        do. With `queued` given the decision is taken before the first await, so two callers in a row
        bring one replica, not two."""
        replicas, scaler = self.replicas, self.scaler
        if replicas is None or scaler is None or replicas.replicas > 0:
            return None
        waiting = await scaler.queued() if queued is None else queued
        if waiting <= 0:
            return None
        decision = replicas.decide(self.clock(), None, None, None, self.policy.params.slo, waiting)
        await scaler.scale(decision)
        return decision

    async def close(self) -> None:
        await self.source.close()
        await self.actuator.close()
