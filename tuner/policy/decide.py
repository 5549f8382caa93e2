"""`Policy`: the steps of one interval in order, over the state, memory, model, candidates and probes of
this package. The order and what each step does are in the package's docstring (`__init__.py`)."""

from __future__ import annotations

from dataclasses import replace

from ..types import Decision, Observation, TunedConfig
from . import reasons, shift
from .candidates import best, candidates, fastest, queues, score
from .load import batch_per_engine, per_engine, similar
from .memory import Memory
from .model import LoadModel, attainment, observed_goodput
from .params import PolicyParams
from .probes import PROBES, Tabooed
from .state import Level, Probation, Shift, Taboo


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
        missed TPOT target), else a probe, else hold."""
        p = self.params
        current = self.current
        assert current is not None
        model = self.model(obs)
        if model is None:
            return self._hold(now, "missing", reasons.NO_STEP_COST)
        here = score(current, current, obs, p.slo, model)
        limit = p.slo.tpot_p95_s * p.slo_headroom
        tabooed = self._tabooed(now)
        allowed = [
            c
            for c in candidates(current, obs, p.slo, p.bounds, p.limits)
            if c != current and not tabooed(c, obs.demand)
        ]
        requests = per_engine(obs.demand or 0.0, obs.engines)
        left_to_replicas = self.replica_room and any(queues(c, current, requests) for c in allowed)
        if self.replica_room:
            allowed = [c for c in allowed if not queues(c, current, requests)]
        options = [score(c, current, obs, p.slo, model) for c in allowed]
        # TPOT misses its target now: a change towards it needs room for itself only (the SLO comes before the
        # budget); it is still judged, so a move the model got wrong is reverted (that revert may be a third)
        tpot_over = obs.tpot_p95_s is not None and obs.tpot_p95_s > p.slo.tpot_p95_s
        top = best(options, current, limit, p.change_penalty)
        if left_to_replicas and (top is None or not options):
            return self._hold(now, "hold", reasons.to_replicas(current, requests), goodput, share)
        if not options:
            return self._hold(now, "hold", reasons.nothing_left(current), goodput, share)
        seen = reasons.figures(obs, goodput, share)
        if top is None:  # nothing is predicted to meet the target: move towards it as far as one step goes
            quick = fastest(options)
            if (
                quick is None
                or here.tpot_p95_s is None
                or quick.tpot_p95_s is None
                or quick.tpot_p95_s > here.tpot_p95_s * (1.0 - p.dead_band)
            ):
                return self._hold(now, "hold", reasons.none_meets(current, limit), goodput, share)
            if not self.level.room(1 if tpot_over else 2, p):
                return self._spent(
                    now, current, f"{quick.config.short()} would move towards the TPOT target", goodput, share
                )
            return self._change(
                now,
                quick.config,
                "change",
                reasons.towards_target(current, quick, obs, p.slo.tpot_p95_s, seen),
                goodput=goodput,
                share=share,
                predicted=quick.goodput,
                demand=obs.demand,
            )
        inherited = self._inherited()
        band = p.inherited_band if inherited else p.dead_band
        if here.goodput > 0:
            gain = top.goodput / here.goodput - 1.0
        else:
            gain = float("inf") if top.goodput > 0 else 0.0
        if gain > band or (tpot_over and top.goodput >= here.goodput * (1.0 - p.dead_band)):
            reason = reasons.better(
                current, top, obs, p.slo.tpot_p95_s, gain, tpot_over and gain <= p.dead_band, seen
            )
            if not self.level.room(1 if tpot_over else 2, p):
                return self._spent(
                    now, current, f"{top.config.short()} is predicted {gain:+.0%}", goodput, share
                )
            return self._change(
                now,
                top.config,
                "change",
                reason,
                goodput=goodput,
                share=share,
                predicted=top.goodput,
                demand=obs.demand,
            )
        knee = self._knee()
        for probe in PROBES:
            found = probe(current, obs, p, knee, tabooed)
            if found is not None:
                config, why = found
                if not self.level.room(2, p):  # a probe is the change most likely to be reverted
                    return self._spent(now, current, f"a probe of {config.short()} ({why})", goodput, share)
                return self._change(
                    now,
                    config,
                    "change",
                    reasons.probe(current, config, why, gain, seen),
                    goodput=goodput,
                    share=share,
                    demand=obs.demand,
                    probe=True,
                )
        return self._hold(
            now, "hold", reasons.dead_band(current, top, gain, band, inherited, seen), goodput, share
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
