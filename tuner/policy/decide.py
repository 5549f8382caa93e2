"""`Policy`: the steps of one interval in order, over the state, memory, model, candidates and probes of
this package. The order and what each step does are in the package's docstring (`__init__.py`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..types import Decision, Observation, TunedConfig
from . import reasons, shift
from .candidates import Scored, best, candidates, fastest, queues, score
from .load import adapter_cap, batch_per_engine, per_engine, similar
from .memory import Memory
from .model import LoadModel, attainment, observed_goodput
from .params import PolicyParams
from .probes import PROBES, Tabooed
from .state import Level, Probation, Shift, Taboo


@dataclass(frozen=True)
class _Step:
    """What the search's steps see in one interval: its figures, the config in force scored, and the
    candidates one bounded step away."""

    now: float
    obs: Observation
    goodput: float | None
    share: float | None
    current: TunedConfig
    here: Scored
    options: list[Scored]
    top: Scored | None  # the best candidate predicted to meet the TPOT limit, if any
    limit: float  # the TPOT p95 the candidates are held to: the target times the headroom
    tpot_over: bool  # the observed TPOT p95 misses its target
    requests: float  # requests per engine
    left_to_replicas: bool  # some candidates were left out because they would queue while replicas can grow
    seen: str  # what the window measured, for the reasons


def _gain(here: Scored, top: Scored) -> float:
    """The best candidate's predicted goodput gain over the config in force."""
    if here.goodput > 0:
        return top.goodput / here.goodput - 1.0
    return float("inf") if top.goodput > 0 else 0.0


class Policy:
    """Stateful across intervals (last good config, probation, taboo list, fitted cost), pure per call."""

    def __init__(self, params: PolicyParams, initial: TunedConfig | None = None) -> None:
        self.params = params
        self.current = initial
        self.last_good = initial
        self.last_change: float | None = None
        self.before_change: TunedConfig | None = None
        self.probation: Probation | None = None
        self.taboo = Taboo()
        self.memory = Memory(params.model)
        self.shift = Shift()
        self.level = Level()  # the load level and the changes made in it (churn)
        self.guard = 0  # speculative_disable_by_batch_size for the engines (0: never); see `shift.guard_at`
        # Set by whoever runs the replica knob beside this policy, before each interval: True while it can
        # still add capacity (`ReplicaPolicy.room`). Then a TPOT over target is the replica knob's to fix,
        # and the search takes no max_num_seqs below the requests per engine: that would only turn TPOT
        # into queueing (TTFT) while the new replica starts, and squeeze the capacity the knob reads.
        self.replica_room = False

    @property
    def manages_guard(self) -> bool:
        """Whether the engines' speculative_disable_by_batch_size is the policy's to set (not with k pinned
        to 0: there is nothing to disable)."""
        return shift.manages_guard(self.params)

    def model(self, obs: Observation) -> LoadModel | None:
        """The goodput model at `obs`'s load, from what the policy has learned so far."""
        return self.memory.model(obs, self.params)

    def decide(self, obs: Observation | None, now: float | None = None) -> Decision:
        decision = self._decide(obs, now)
        return replace(decision, changes_this_load=self.level.changes)

    def _decide(self, obs: Observation | None, now: float | None = None) -> Decision:
        now = obs.time if obs is not None else (now or 0.0)
        p = self.params
        if obs is None or obs.error:
            return self._hold(now, "missing", reasons.no_observation(obs))
        if self.current is None:
            if obs.config is None:
                return self._hold(now, "missing", reasons.UNKNOWN_CONFIG)
            self.current = self.last_good = obs.config
        if not p.bounds.contains(self.current):
            return self._change(
                now,
                p.bounds.clamp(self.current),
                "change",
                reasons.out_of_bounds(self.current, p.bounds),
                probation=False,
            )
        self.memory.learn(obs)
        demand = obs.demand
        if (demand or 0.0) < p.min_demand and (obs.request_rate or 0.0) * p.window_s < 1.0:
            return self._hold(now, "idle", reasons.IDLE)
        if demand is None or obs.generation_rate is None or obs.tpot_p95_s is None and obs.ttft_p95_s is None:
            return self._hold(now, "missing", reasons.METRICS_MISSING)
        shifted = self._load_shift(now, obs)
        if shifted is not None:
            return shifted
        decision = self._settled(now, obs)
        self.guard = self._guard_at(demand, obs.engines)
        return decision

    def freeze(self, obs: Observation, by: str) -> Decision:
        """Frozen by a person (`by` says how): no decision. A change on probation is dropped (its window is
        no longer the tuner's to judge), and the cooldown restarts at every frozen interval, so the first
        windows after the freeze, which may mix a config set by hand, are not read as the tuner's."""
        self.probation = None
        self.last_change = obs.time
        return Decision(obs.time, None, reasons.frozen(by, self.current or obs.config), "frozen")

    def no_engine(self, now: float) -> Decision:
        """No engine is ready (scaled to zero, pods starting or Pending): its metrics are missing because
        nothing runs, not because monitoring failed. Hold, idle, so that fail static (and the
        SpecfleetTunerFailingStatic alert on its count) means engines that run but cannot be observed."""
        return Decision(now, None, reasons.NO_ENGINE, "idle", changes_this_load=self.level.changes)

    def rejected(self, now: float, config: TunedConfig, error: str) -> Decision:
        """The engines refused `config` (a ceiling the bounds did not know): go back and never retry it."""
        previous = self.before_change if self.current == config else self.current
        self.probation = None
        self.taboo.refuse(config, self.before_change)
        if previous is None or previous == config:
            return Decision(now, None, reasons.refused(config, error, None), "hold")
        self.current = previous
        self.last_change = now
        self.level.count()
        return Decision(now, previous, reasons.refused(config, error, previous), "revert")

    # -- steps -------------------------------------------------------------------------------------

    def _load_shift(self, now: float, obs: Observation) -> Decision | None:
        """Step 3: the load moved within the window, so its figures mix two loads: hold until a window at
        one load, except where the knee decides alone (`shift.py`). The search takes over at the first
        clean window."""
        assert self.current is not None
        seen = self.shift.see(now, obs, self.params)
        if seen is None:
            return None
        before, after, previous = seen
        if self.shift.since == now:  # the first window of this shift: a new load level begins
            self.level.begin(now, after)
        what, knee = reasons.shifting(before, after), self._knee()
        batch = batch_per_engine(after, obs.engines, self.current.max_num_seqs)
        off = shift.off_on_rise(self.current, obs, after, knee, self.params, self._tabooed(now))
        if off is not None:
            self.probation = None  # the load it would be judged at is gone
            return self._change(
                now, off, "change", reasons.shift_off(self.current, off, what, batch, knee), probation=False
            )
        # on only when the count was low at the previous interval too: under a heavy closed loop requests
        # finish in waves, and one scrape can land in the trough of one
        load = max(after, previous or 0.0)
        on = (
            None
            if previous is None
            else shift.on_on_fall(self.current, obs, load, knee, self.params, self.memory, self._tabooed(now))
        )
        if on is not None:
            config, gain = on
            self.probation = None
            decision = self._change(
                now,
                config,
                "change",
                reasons.shift_on(self.current, config, what, batch, knee, gain),
                probation=False,
            )
            self.guard = self._guard_at(load, obs.engines)
            return decision
        return self._hold(now, "hold", reasons.shift_hold(self.current, what))

    def _settled(self, now: float, obs: Observation) -> Decision:
        """Steps 4-7, at a window of one load."""
        p = self.params
        self.level.follow(now, obs.demand, p)
        if self.last_change is not None and now - self.last_change < p.cooldown_s:
            return self._hold(now, "cooldown", reasons.cooldown(p.cooldown_s - (now - self.last_change)))
        goodput = observed_goodput(obs, p.slo)
        share = attainment(obs, p.slo)
        if self.probation is not None:
            verdict = self._judge(now, obs, goodput, share)
            if verdict is not None:
                return verdict
        return self._search(now, obs, goodput, share)

    def _judge(
        self, now: float, obs: Observation, goodput: float | None, share: float | None
    ) -> Decision | None:
        """Step 5: the first clean window after a change judges it at a comparable load; a change that lost
        is reverted and its move tabooed at this load, a probe that held keeps the way back tabooed."""
        trial, self.probation = self.probation, None
        assert trial is not None
        p = self.params
        if not similar(obs.demand, trial.baseline_demand, p):
            self.last_good = self.current
            return None  # the load moved: the comparison says nothing; search afresh from here
        lost, missed = trial.lost(goodput, p), trial.missed(share, p)
        if not (lost or missed):
            self.last_good = self.current
            if trial.probe:  # measured no worse: the model's case for going back is not to be trusted here
                self.taboo.forbid(trial.tried, trial.previous, obs.demand, now + p.taboo_s)
            return None
        self.taboo.forbid(trial.previous, trial.tried, obs.demand, now + p.taboo_s)
        reason = reasons.revert(
            trial.tried,
            trial.previous,
            lost,
            goodput,
            share,
            trial.baseline_goodput,
            trial.baseline_attainment,
        )
        return self._change(
            now, trial.previous, "revert", reason, probation=False, goodput=goodput, share=share
        )

    def _search(self, now: float, obs: Observation, goodput: float | None, share: float | None) -> Decision:
        """Steps 6-7: the best candidate one bounded step away if it clears the dead band (or meets a
        missed TPOT target), else a probe, else hold. Each step returns its decision, or None to pass on."""
        model = self.model(obs)
        if model is None:
            return self._hold(now, "missing", reasons.NO_STEP_COST)
        s = self._options(now, obs, goodput, share, model)
        if s.top is None:
            return self._nothing_to_choose(s) or self._towards_target(s)
        gain = _gain(s.here, s.top)
        return (
            self._nothing_to_choose(s)
            or self._better(s, s.top, gain)
            or self._probe(s, gain)
            or self._dead_band(s, s.top, gain)
        )

    def _options(
        self, now: float, obs: Observation, goodput: float | None, share: float | None, model: LoadModel
    ) -> _Step:
        """The candidates one bounded step away that are not tabooed (nor, while the replica knob has room,
        queueing), scored at this interval's load."""
        p = self.params
        current = self.current
        assert current is not None
        tabooed = self._tabooed(now)
        allowed = [
            c
            for c in candidates(current, obs, p.slo, p.bounds, p.limits)
            if c != current and not tabooed(c, obs.demand)
        ]
        cap = adapter_cap(obs, current.max_num_seqs)
        if cap is not None:  # requests waiting on an adapter slot would not run in a longer batch
            allowed = [c for c in allowed if c.max_num_seqs <= cap]
        requests = per_engine(obs.demand or 0.0, obs.engines)
        left_to_replicas = self.replica_room and any(queues(c, current, requests) for c in allowed)
        if self.replica_room:
            allowed = [c for c in allowed if not queues(c, current, requests)]
        options = [score(c, current, obs, p.slo, model) for c in allowed]
        limit = p.slo.tpot_p95_s * p.slo_headroom
        return _Step(
            now=now,
            obs=obs,
            goodput=goodput,
            share=share,
            current=current,
            here=score(current, current, obs, p.slo, model),
            options=options,
            top=best(options, current, limit, p.change_penalty),
            limit=limit,
            # TPOT misses its target now: a change towards it needs room for itself only (the SLO comes before
            # the budget); it is still judged, so a move the model got wrong is reverted (that may be a third)
            tpot_over=obs.tpot_p95_s is not None and obs.tpot_p95_s > p.slo.tpot_p95_s,
            requests=requests,
            left_to_replicas=left_to_replicas,
            seen=reasons.figures(obs, goodput, share) + reasons.adapter_slots(obs, cap),
        )

    def _nothing_to_choose(self, s: _Step) -> Decision | None:
        """Hold when the replica knob is left the missed target, or no candidate is left at all."""
        if s.left_to_replicas and (s.top is None or not s.options):
            return self._hold(s.now, "hold", reasons.to_replicas(s.current, s.requests), s.goodput, s.share)
        if not s.options:
            return self._hold(s.now, "hold", reasons.nothing_left(s.current), s.goodput, s.share)
        return None

    def _towards_target(self, s: _Step) -> Decision:
        """Nothing is predicted to meet the target: move towards it as far as one step goes, if that step is
        clearly faster than the config in force."""
        p = self.params
        quick = fastest(s.options)
        if (
            quick is None
            or s.here.tpot_p95_s is None
            or quick.tpot_p95_s is None
            or quick.tpot_p95_s > s.here.tpot_p95_s * (1.0 - p.dead_band)
        ):
            return self._hold(s.now, "hold", reasons.none_meets(s.current, s.limit), s.goodput, s.share)
        if not self.level.room(1 if s.tpot_over else 2, p):
            return self._spent(
                s.now,
                s.current,
                f"{quick.config.short()} would move towards the TPOT target",
                s.goodput,
                s.share,
            )
        return self._change(
            s.now,
            quick.config,
            "change",
            reasons.towards_target(s.current, quick, s.obs, p.slo.tpot_p95_s, s.seen),
            goodput=s.goodput,
            share=s.share,
            predicted=quick.goodput,
            demand=s.obs.demand,
        )

    def _better(self, s: _Step, top: Scored, gain: float) -> Decision | None:
        """The best candidate, when its predicted gain clears the dead band (or it keeps goodput within the
        band while TPOT misses its target)."""
        p = self.params
        band = p.inherited_band if self._inherited() else p.dead_band
        if not (gain > band or (s.tpot_over and top.goodput >= s.here.goodput * (1.0 - p.dead_band))):
            return None
        reason = reasons.better(
            s.current, top, s.obs, p.slo.tpot_p95_s, gain, s.tpot_over and gain <= p.dead_band, s.seen
        )
        if not self.level.room(1 if s.tpot_over else 2, p):
            return self._spent(
                s.now, s.current, f"{top.config.short()} is predicted {gain:+.0%}", s.goodput, s.share
            )
        return self._change(
            s.now,
            top.config,
            "change",
            reason,
            goodput=s.goodput,
            share=s.share,
            predicted=top.goodput,
            demand=s.obs.demand,
        )

    def _probe(self, s: _Step, gain: float) -> Decision | None:
        """The first probe that finds a config to try, when no candidate clears the band."""
        p = self.params
        knee = self._knee()
        tabooed = self._tabooed(s.now)
        for probe in PROBES:
            found = probe(s.current, s.obs, p, knee, tabooed)
            if found is not None:
                config, why = found
                if not self.level.room(2, p):  # a probe is the change most likely to be reverted
                    return self._spent(
                        s.now, s.current, f"a probe of {config.short()} ({why})", s.goodput, s.share
                    )
                return self._change(
                    s.now,
                    config,
                    "change",
                    reasons.probe(s.current, config, why, gain, s.seen),
                    goodput=s.goodput,
                    share=s.share,
                    demand=s.obs.demand,
                    probe=True,
                )
        return None

    def _dead_band(self, s: _Step, top: Scored, gain: float) -> Decision:
        """Hold: the best candidate's gain is within the dead band and no probe applies."""
        inherited = self._inherited()
        band = self.params.inherited_band if inherited else self.params.dead_band
        return self._hold(
            s.now,
            "hold",
            reasons.dead_band(s.current, top, gain, band, inherited, s.seen),
            s.goodput,
            s.share,
        )

    # -- helpers -----------------------------------------------------------------------------------

    def _inherited(self) -> bool:
        """Whether the config in force was set before this load level began (by the spec, or chosen for
        another load) and nothing has changed it since."""
        since = self.level.since
        return (
            self.level.changes == 0
            and since is not None
            and (self.last_change is None or self.last_change < since)
        )

    def _knee(self) -> float:
        return self.memory.knee(self.params.model)

    def _guard_at(self, load: float, engines: int) -> int:
        assert self.current is not None
        return shift.guard_at(load, engines, self._knee(), self.current, self.params)

    def _tabooed(self, now: float) -> Tabooed:
        return lambda config, load: self.taboo.covers(config, load, now, self.params)

    def _hold(
        self, now: float, kind: str, why: str, goodput: float | None = None, share: float | None = None
    ) -> Decision:
        if kind == "missing":
            why = reasons.fail_static(why, self.current)
        return Decision(now, None, why, kind, observed_goodput=goodput, slo_attainment=share)

    def _spent(
        self, now: float, current: TunedConfig, wanted: str, goodput: float | None, share: float | None
    ) -> Decision:
        why = reasons.budget_spent(current, wanted, self.level.changes, self.params.max_changes_per_load)
        return self._hold(now, "hold", why, goodput, share)

    def _change(
        self,
        now: float,
        config: TunedConfig,
        kind: str,
        reason: str,
        *,
        probation: bool = True,
        goodput: float | None = None,
        share: float | None = None,
        predicted: float | None = None,
        demand: float | None = None,
        probe: bool = False,
    ) -> Decision:
        previous = self.before_change = self.current
        if probation and previous is not None:
            self.probation = Probation(previous, config, goodput, share, demand, now, probe)
        self.current = config
        self.last_change = now
        self.level.count()
        return Decision(now, config, reason, kind, predicted, goodput, share)
