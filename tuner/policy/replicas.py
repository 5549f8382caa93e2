"""Replicas as the tuner's knob across pods, decided from the same goodput model as k and batch limits.

Within a pod the tuner keeps choosing the config; this decides how many pods run it:
- capacity per replica: the most requests in the system one engine can hold with the model's mean TPOT
  within `tpot_margin` of the SLO's p95 target, under the config in force (the tuner's best so far), and
  never past `max_num_seqs` (beyond it requests wait and TTFT grows);
- recommendation: enough replicas for the demand (requests in the system, plus any the router holds while
  no engine is ready) at that capacity; one fewer only when the demand fits in one fewer replica with
  `headroom` to spare; one more also when the SLO is missed with requests waiting (the model's error);
- stabilization as the HPA's: a scale-up takes the lowest recommendation of the last `scale_up_window_s`,
  a scale-down the highest of the last `scale_down_window_s`; after any change, `cooldown_s` with none
  (a new pod must load and show in a rate window); one replica per decision;
- scale to zero: with `min_replicas` 0 an idle service goes to zero after the scale-down window, and the
  first request the router queues brings one replica back at once.
Pure: observations and the clock in, a decision with its reason out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from specfleet.engine.knobs import REPLICAS

from ..types import SLO, Observation, TunedConfig
from .model import LoadModel, attainment


@dataclass(frozen=True)
class ReplicaParams:
    # The knob's default range, as `spec.autoscaling`'s (specfleet.engine.knobs.REPLICAS.search).
    min_replicas: int = (REPLICAS.search or (1, 1))[0]
    max_replicas: int = (REPLICAS.search or (1, 1))[1]
    # The HPA's defaults: scale up at once, scale down on the highest recommendation of the last 5 minutes.
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    # A model loads in 30 s to 5 min and its effect shows one rate window later: no second change before.
    cooldown_s: float = 60.0
    # One fewer replica only if the demand then loads the rest to at most 80% of their capacity: a load
    # that wobbles by 20% does not flap between two counts.
    headroom: float = 0.8
    # The model predicts a mean TPOT; the SLO is a p95. 0.8 of the target for the mean leaves the p95 within
    # it (docs/decisions/009-replica-knob.md).
    tpot_margin: float = 0.8
    # An SLO attainment below this with requests waiting adds a replica whatever the model says.
    min_attainment: float = 0.9

    def __post_init__(self) -> None:
        if not REPLICAS.minimum <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"minReplicas={self.min_replicas} must be >= {REPLICAS.minimum} and <= "
                f"maxReplicas={self.max_replicas}"
            )


@dataclass(frozen=True)
class ReplicaDecision:
    time: float
    replicas: int  # the count wanted now (equal to the current one for a hold)
    previous: int
    kind: str  # scale-up | scale-down | hold | cooldown | stabilizing
    reason: str

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous

    @property
    def notable(self) -> bool:
        """Worth keeping in a run's decisions: a change, or a reason one is held back (stabilizing, cooldown);
        a plain hold that changes nothing is not (the local fleet, the simulator and its timeline agree)."""
        return self.kind != "hold" or self.changed


def capacity_per_replica(model: LoadModel, config: TunedConfig, slo: SLO, margin: float) -> float:
    """Requests in the system one engine holds with predicted mean TPOT <= margin * the p95 target."""
    best = 1
    for load in range(1, max(1, config.max_num_seqs) + 1):
        if replace(model, demand=float(load), engines=1).predict(config).tpot_s > margin * slo.tpot_p95_s:
            break
        best = load
    return float(best)


def rising_demand(obs: Observation) -> float:
    """Requests in the system for the replica count: the window's mean, or the count at its end when that
    is higher. A rise then shows at the first interval after it, as the config's load-shift rule reads it,
    instead of once the rate window has filled with it (docs/decisions/009-replica-knob.md); a fall still
    waits for the window, and a scale-down for its own window."""
    return max(obs.demand or 0.0, obs.in_system_now or 0.0)


@dataclass
class ReplicaPolicy:
    params: ReplicaParams
    replicas: int
    last_change: float = -math.inf
    _recommendations: list[tuple[float, int]] = field(default_factory=list)
    _since: float | None = None  # the first recommendation since the last change
    serving: int | None = None  # pods serving at the last observation (None: none seen yet)

    @property
    def room(self) -> bool:
        """Whether this knob can still add capacity: below maxReplicas, or a replica it added is not serving
        yet. The config policy then leaves a TPOT over target to it (`Policy.replica_room`)."""
        wanted = self.replicas
        return wanted < self.params.max_replicas or (self.serving is not None and self.serving < wanted)

    def decide(
        self,
        now: float,
        obs: Observation | None,
        model: LoadModel | None,
        config: TunedConfig | None,
        slo: SLO,
        queued: int = 0,
    ) -> ReplicaDecision:
        p, current = self.params, self.replicas
        if obs is not None and not obs.error:
            self.serving = obs.pods
        if current == 0:  # scale from zero: no engine can be observed; the router's queue is the signal
            if queued > 0 and p.max_replicas > 0:
                return self._change(
                    now,
                    1,
                    "scale-up",
                    f"{queued} request(s) wait in the router with no replica (scale from zero)",
                )
            return ReplicaDecision(now, 0, 0, "hold", "no replica and no request waiting")
        target, why = self._recommend(obs, model, config, slo, queued)
        target = max(p.min_replicas, min(p.max_replicas, target))
        if self._since is None:
            self._since = now
        horizon = max(p.scale_up_window_s, p.scale_down_window_s)
        self._recommendations = [(t, r) for t, r in self._recommendations if now - t <= horizon]
        self._recommendations.append((now, target))
        if target == current:
            return ReplicaDecision(now, current, current, "hold", why)
        if target > current:
            stable = min(r for t, r in self._recommendations if now - t <= p.scale_up_window_s)
        else:
            if now - self._since < p.scale_down_window_s:
                return ReplicaDecision(
                    now,
                    current,
                    current,
                    "stabilizing",
                    f"{why}; a scale-down waits until the "
                    f"recommendation held for the {p.scale_down_window_s:.0f}s window",
                )
            stable = max(r for t, r in self._recommendations if now - t <= p.scale_down_window_s)
        if stable == current:
            return ReplicaDecision(
                now, current, current, "stabilizing", f"{why}; not yet stable over the window"
            )
        if now - self.last_change < p.cooldown_s:
            return ReplicaDecision(
                now,
                current,
                current,
                "cooldown",
                f"{why}; in the {p.cooldown_s:.0f}s cooldown after the last replica change",
            )
        step = current + (1 if stable > current else -1)
        return self._change(now, step, "scale-up" if step > current else "scale-down", why)

    def _recommend(
        self,
        obs: Observation | None,
        model: LoadModel | None,
        config: TunedConfig | None,
        slo: SLO,
        queued: int,
    ) -> tuple[int, str]:
        p, current = self.params, self.replicas
        if obs is None or obs.error:
            return current, "no observation: replicas held"
        demand = rising_demand(obs) + queued
        idle = demand < 0.5 and (obs.request_rate or 0.0) == 0.0
        if idle:
            return (
                p.min_replicas,
                f"idle: no request in the system; the floor is minReplicas={p.min_replicas}",
            )
        share = attainment(obs, slo)
        missed = share is not None and share < p.min_attainment and (obs.waiting or 0.0) > 0
        if model is None or config is None:
            if missed:
                return current + 1, (
                    f"SLO attainment is {share:.2f} with {obs.waiting:.0f} requests waiting "
                    "(the goodput model has too few measurements yet)"
                )
            return current, "the goodput model has too few measurements yet: replicas held"
        cap = capacity_per_replica(model, config, slo, p.tpot_margin)
        need = math.ceil(demand / cap)
        what = (
            f"{demand:.1f} requests in the system at {cap:.0f} per replica (the goodput model's capacity "
            f"with {config.short()} at TPOT <= {p.tpot_margin:g} x {slo.tpot_p95_s * 1000:.0f} ms)"
        )
        if need <= current and missed:
            return (
                current + 1,
                f"{what} fit in {current}, but SLO attainment is {share:.2f} with requests waiting",
            )
        if need > current:
            return need, f"{what} need {need} replicas"
        fewer = math.ceil(demand / (cap * p.headroom))
        if fewer < current:
            return fewer, f"{what} fit in {fewer} with {1 - p.headroom:.0%} headroom"
        return current, f"{what} need {current} replica(s)"

    def _change(self, now: float, replicas: int, kind: str, reason: str) -> ReplicaDecision:
        decision = ReplicaDecision(
            now, replicas, self.replicas, kind, f"{kind} {self.replicas} -> {replicas}: {reason}"
        )
        self.replicas, self.last_change, self._since = replicas, now, now
        return decision
