"""The tuning policy: observations in, one decision with a reason out. No I/O, no clock of its own.

Per interval:
1. data missing or the source down: hold the last good config and say so (fail static);
2. no traffic: hold (nothing to learn from an idle service);
3. load shift: the load moved within the window (its figures mix two loads): hold, except that
   speculation goes off at once when the load rose past the step cost's knee, and on when it fell under it;
4. cooldown: the rate window still mixes samples from before the last change, so wait;
5. probation: a change is judged on the first clean window; if goodput or SLO attainment got worse by more
   than the margin (at a comparable load), revert it and do not retry it at that load for a while;
6. search: candidates one bounded step away (k +-4 or off, max_num_seqs x2 or /2), scored by predicted
   goodput (see `goodput.py`, `search.py`); change only if the best beats the config in force by more than
   the dead band, or if the SLO is missed now and the candidate is predicted to meet it;
7. probes, where the model cannot tell: speculation off past the knee (a proposer's own cost is
   invisible to it), a longer draft below it (acceptance past the measured positions is a guess), a
   shorter one when the last positions are rarely accepted; each judged by probation like any change.
Candidates are always inside the bounds, and a config outside them is moved inside first.

Beside the config, the policy keeps `guard`, the engines' `speculative_disable_by_batch_size`: the rule
of step 3 for a rise past the knee, applied by the engine at its next step instead of by the tuner at
its next interval. It follows the load at every settled interval and is not a decision of its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from .goodput import DEFAULT_COST_RATIO, LoadModel, attainment, fit_step_cost, observed_goodput
from .search import StepLimits, candidates, score
from .types import SLO, Decision, Observation, TuneBounds, TunedConfig


@dataclass(frozen=True)
class PolicyParams:
    slo: SLO
    bounds: TuneBounds = field(default_factory=TuneBounds)
    window_s: float = 30.0  # rate window of the observations
    interval_s: float = 30.0
    dead_band: float = 0.10  # a change must promise this much more goodput
    revert_margin: float = 0.05  # a change that lost this much goodput (or attainment) is reverted
    slo_headroom: float = 0.9  # candidates must keep predicted TPOT p95 under this share of the target
    taboo_s: float = 600.0  # a reverted config is not retried at a similar load for this long
    # acceptance measured while k > 0 is trusted this long once k = 0, and only at a similar load (a load
    # that moved is often other traffic: grounded prompts at concurrency 1, chat at 32)
    acceptance_ttl_s: float = 300.0
    min_demand: float = 0.05  # below this (requests in the system) the service counts as idle
    limits: StepLimits = field(default_factory=StepLimits)
    up_probe_acceptance: float = 0.5  # raise k as a measurement while its last position is accepted this often
    # drop, as a measurement, the last positions accepted less often than this, when the last one is
    # accepted less than two thirds as often (hysteresis: a position near the line is not probed twice).
    # Below the break-even: on chat at concurrency 2, k=4 with its last position at 8% measured equal to
    # k=2, so a probe there measures only noise (and a noisy window reverts it: one change more)
    down_probe_acceptance: float = 0.08
    shift_hold_s: float | None = None  # hold through a load shift at most this long (default: 2 windows)
    guard: bool = True  # keep the engines' speculative_disable_by_batch_size at the load-shift rule's batch

    @property
    def cooldown_s(self) -> float:
        """A change is applied right after the scrape that decided it, so a rate window ending this long
        later holds only samples taken under it."""
        return self.window_s


@dataclass
class _Probation:
    previous: TunedConfig
    tried: TunedConfig
    baseline_goodput: float | None
    baseline_attainment: float | None
    baseline_demand: float | None
    since: float
    probe: bool = False  # a measurement the model could not make (see Policy._probe_off and the others)


def _similar(a: float | None, b: float | None, tolerance: float = 0.4) -> bool:
    if a is None or b is None:
        return True
    return abs(a - b) <= tolerance * max(a, b, 1.0)


def _distance(a: TunedConfig, b: TunedConfig) -> int:
    """Knobs that differ: among equally good candidates the one that changes least wins."""
    return sum(x != y for x, y in zip(a.as_admin().values(), b.as_admin().values(), strict=True))


def _directions(before: TunedConfig, after: TunedConfig) -> list[tuple[str, tuple[float, float]]]:
    """The moves a reverted change made, as value ranges not to try again: raising k from 2 to 4 made
    things worse, so no k above 2 (at this load) either."""
    old, new = before.as_admin(), after.as_admin()
    spans = []
    for knob, value in new.items():
        if value > old[knob]:
            spans.append((knob, (old[knob] + 1, float("inf"))))
        elif value < old[knob]:
            spans.append((knob, (float("-inf"), old[knob] - 1)))
    return spans


class Policy:
    """Stateful across intervals (last good config, probation, taboo list, fitted cost), pure per call."""

    def __init__(self, params: PolicyParams, initial: TunedConfig | None = None) -> None:
        self.params = params
        self.current = initial
        self.last_good = initial
        self.last_change: float | None = None
        self.before_change: TunedConfig | None = None
        self.probation: _Probation | None = None
        # (knob, [low, high] of values not to try, demand it was judged at, until when)
        self.taboo: list[tuple[str, tuple[float, float], float | None, float]] = []
        self.cost_points: deque[tuple[float, float, float]] = deque(maxlen=40)  # (decode, prefill, seconds)
        # The same from windows without proposals: the target's own step, free of any proposer's cost.
        self.plain_cost_points: deque[tuple[float, float, float]] = deque(maxlen=40)
        # (demand, per_pos, share, time) of recent windows that verified drafts
        self.acceptance: deque[tuple[float | None, tuple[float, ...], float, float]] = deque(maxlen=16)
        self.shift_since: float | None = None  # when the load was first seen shifting within a window
        self.load_now_before: float | None = None  # the gauges' count at the previous interval
        self.guard = 0  # speculative_disable_by_batch_size for the engines (0: never); see `_guard_at`

    def decide(self, obs: Observation | None, now: float | None = None) -> Decision:
        now = obs.time if obs is not None else (now or 0.0)
        p = self.params
        if obs is None or obs.error:
            return self._hold(now, "missing", f"no observation ({obs.error if obs else 'none'})")
        if self.current is None:
            if obs.config is None:
                return self._hold(now, "missing", "the config in force is unknown (no pod reported it)")
            self.current = self.last_good = obs.config
        if not p.bounds.contains(self.current):
            return self._change(now, p.bounds.clamp(self.current), "change",
                                f"{self.current.short()} lies outside the bounds {p.bounds}; moved inside",
                                probation=False)
        self._learn(obs)
        demand = obs.demand
        if (demand or 0.0) < p.min_demand and (obs.request_rate or 0.0) * p.window_s < 1.0:
            return self._hold(now, "idle", "no traffic in the window; nothing to tune on")
        if demand is None or obs.generation_rate is None or obs.tpot_p95_s is None and obs.ttft_p95_s is None:
            return self._hold(now, "missing", "latency, throughput or queue metrics missing from the window")
        shifted = self._load_shift(now, obs)
        if shifted is not None:
            return shifted
        decision = self._settled(now, obs)
        self.guard = self._guard_at(demand, obs.engines)
        return decision

    def _settled(self, now: float, obs: Observation) -> Decision:
        """Steps 4-7, at a window of one load."""
        p = self.params
        if self.last_change is not None and now - self.last_change < p.cooldown_s:
            left = p.cooldown_s - (now - self.last_change)
            return self._hold(now, "cooldown", f"cooldown: {left:.0f}s until a window without samples "
                              "from before the last change")
        goodput = observed_goodput(obs, p.slo)
        share = attainment(obs, p.slo)
        if self.probation is not None:
            verdict = self._judge(now, obs, goodput, share)
            if verdict is not None:
                return verdict
        return self._search(now, obs, goodput, share)

    # -- steps -------------------------------------------------------------------------------------

    def _judge(self, now: float, obs: Observation, goodput: float | None, share: float | None) -> Decision | None:
        trial, self.probation = self.probation, None
        assert trial is not None
        if not _similar(obs.demand, trial.baseline_demand):
            self.last_good = self.current
            return None  # the load moved: the comparison says nothing; search afresh from here
        lost = (goodput is not None and trial.baseline_goodput is not None
                and goodput < trial.baseline_goodput * (1.0 - self.params.revert_margin))
        missed = (share is not None and trial.baseline_attainment is not None
                  and share < trial.baseline_attainment - self.params.revert_margin)
        if not (lost or missed):
            self.last_good = self.current
            if trial.probe:  # measured no worse: the model's case for going back is not to be trusted here
                self.taboo += [(knob, span, obs.demand, now + self.params.taboo_s)
                               for knob, span in _directions(trial.tried, trial.previous)]
            return None
        self.taboo += [(knob, span, obs.demand, now + self.params.taboo_s)
                       for knob, span in _directions(trial.previous, trial.tried)]
        what = (f"goodput {goodput:.1f} < {trial.baseline_goodput:.1f} tok/s before" if lost
                else f"SLO attainment {share:.0%} < {trial.baseline_attainment:.0%} before")
        return self._change(now, trial.previous, "revert",
                            f"reverted {trial.tried.short()}: {what}; back to {trial.previous.short()}",
                            probation=False, goodput=goodput, share=share)

    def _search(self, now: float, obs: Observation, goodput: float | None, share: float | None) -> Decision:
        p = self.params
        assert self.current is not None
        model = self._model(obs)
        if model is None:
            return self._hold(now, "missing", "no step duration or batch size in the window to model step cost")
        here = score(self.current, self.current, obs, p.slo, model)
        limit = p.slo.tpot_p95_s * p.slo_headroom
        options = [score(c, self.current, obs, p.slo, model)
                   for c in candidates(self.current, obs, p.slo, p.bounds, p.limits)
                   if c != self.current and not self._tabooed(c, obs.demand, now)]
        safe = [s for s in options if s.tpot_p95_s is None or s.tpot_p95_s <= limit]
        tpot_over = obs.tpot_p95_s is not None and obs.tpot_p95_s > p.slo.tpot_p95_s
        best = max(safe, key=lambda s: s.goodput * (1.0 - 0.02 * _distance(s.config, self.current)), default=None)
        if not options:
            return self._hold(now, "hold", f"keeping {self.current.short()}: no other config within the bounds "
                              "that was not measured worse at this load", goodput, share)
        if best is None:  # nothing is predicted to meet the target: move towards it as far as one step goes
            fastest = min(options, key=lambda s: (s.tpot_p95_s or 0.0, -s.goodput), default=None)
            if fastest is None or here.tpot_p95_s is None or fastest.tpot_p95_s is None or \
                    fastest.tpot_p95_s > here.tpot_p95_s * (1.0 - p.dead_band):
                return self._hold(now, "hold", f"no candidate keeps TPOT p95 under {limit * 1000:.0f} ms or "
                                  f"lowers it; holding {self.current.short()}", goodput, share)
            reason = (f"{self.current.short()} -> {fastest.config.short()}: TPOT p95 "
                      f"{self._ms(obs.tpot_p95_s)} over target {p.slo.tpot_p95_s * 1000:.0f} ms, no config one "
                      f"step away meets it; predicted {self._ms(fastest.tpot_p95_s)}; "
                      f"{self._figures(obs, goodput, share)}")
            return self._change(now, fastest.config, "change", reason, goodput=goodput, share=share,
                                predicted=fastest.goodput, demand=obs.demand)
        if here.goodput > 0:
            gain = best.goodput / here.goodput - 1.0
        else:
            gain = float("inf") if best.goodput > 0 else 0.0
        figures = self._figures(obs, goodput, share)
        if gain > p.dead_band or (tpot_over and best.goodput >= here.goodput * (1.0 - p.dead_band)):
            why = (f"TPOT p95 {obs.tpot_p95_s * 1000:.0f} ms over target {p.slo.tpot_p95_s * 1000:.0f} ms"
                   if tpot_over and gain <= p.dead_band else f"predicted goodput +{gain:.0%}")
            reason = (f"{self.current.short()} -> {best.config.short()}: {why} "
                      f"(predicted {best.goodput:.1f} tok/s, TPOT p95 {self._ms(best.tpot_p95_s)}); {figures}")
            return self._change(now, best.config, "change", reason, goodput=goodput, share=share,
                                predicted=best.goodput, demand=obs.demand)
        for probe in (self._probe_off, self._probe_up, self._probe_down):
            found = probe(obs, now)
            if found is not None:
                config, why = found
                reason = (f"{self.current.short()} -> {config.short()}: {why} (best alternative predicted "
                          f"{gain:+.0%}); kept unless measured goodput drops; {figures}")
                return self._change(now, config, "change", reason, goodput=goodput, share=share,
                                    demand=obs.demand, probe=True)
        return self._hold(now, "hold", f"keeping {self.current.short()}: best alternative "
                          f"{best.config.short()} predicts {gain:+.0%} (dead band {p.dead_band:.0%}); {figures}",
                          goodput, share)

    def _knee(self) -> float:
        """Tokens per step where the target's step turns compute-bound, from windows without proposals
        (with them, a draft's passes would read as compute); the prior's knee until there are some."""
        plain = fit_step_cost(list(self.plain_cost_points))
        if plain is None or plain.c1 <= 0:
            return 1.0 / DEFAULT_COST_RATIO
        return plain.c0 / plain.c1

    def _probe_off(self, obs: Observation, now: float) -> tuple[TunedConfig, str] | None:
        """Speculation off, to be measured, when the model cannot tell: the batch alone fills the step past
        the knee (compute-bound), so every proposed token costs compute, and the proposer's own cost is
        invisible to a model of the target's step. Not when k = 0 is already tabooed at this load.
        Returns (config, why)."""
        assert self.current is not None
        if self.current.num_speculative_tokens == 0 or self.params.bounds.k[0] > 0:
            return None
        batch = min((obs.demand or 0.0) / obs.engines, float(self.current.max_num_seqs))
        knee = self._knee()
        if batch < knee:
            return None
        off = self.current.with_(num_speculative_tokens=0)
        if self._tabooed(off, obs.demand, now):
            return None
        return off, (f"probing speculation off: {batch:.0f} sequences per step are past the step cost's knee "
                     f"({knee:.0f} tokens), where what proposing costs (a draft model's own passes) can "
                     "outweigh what it saves and the model cannot see it")

    def _probe_up(self, obs: Observation, now: float) -> tuple[TunedConfig, str] | None:
        """k up one bounded step, to be measured, when the model calls it a wash but cannot know: the
        drafts are still accepted at their last position (`up_probe_acceptance`), so positions past it
        are unmeasured, and the verification step is under the knee (memory-bound: more draft tokens
        cost little). Returns (config, why)."""
        assert self.current is not None
        k, high = self.current.num_speculative_tokens, self.params.bounds.k[1]
        acc = obs.accepted_per_pos
        if k == 0 or k >= high or len(acc) < k or acc[k - 1] < self.params.up_probe_acceptance:
            return None
        share = obs.proposal_share
        if share is None:
            return None
        seqs = self.current.max_num_seqs
        batch = max(1.0, min((obs.demand or 0.0) / obs.engines, float(seqs)))
        knee, tokens = self._knee(), batch * (1.0 + share * k)
        if tokens >= knee:
            return None
        new_k = min(high, k + self.params.limits.max_k_step)
        up = self.params.bounds.clamp(TunedConfig(new_k, seqs, max(self.current.max_num_batched_tokens,
                                                                   seqs * (1 + new_k))))
        if self._tabooed(up, obs.demand, now):
            return None
        return up, (f"probing a longer draft: its last position is still accepted {acc[k - 1]:.0%} of the "
                    f"time and the verification step ({tokens:.1f} tokens) is under the knee ({knee:.0f} "
                    "tokens), where more draft tokens cost little and the model's extrapolation past the "
                    "measured positions is a guess")

    def _probe_down(self, obs: Observation, now: float) -> tuple[TunedConfig, str] | None:
        """The mirror of the longer-draft probe: the last position is rarely accepted (under two thirds
        of `down_probe_acceptance`), so drop the positions under `down_probe_acceptance` from the end
        (down to at least 1, and one bounded step), to be measured. Returns (config, why)."""
        assert self.current is not None
        k, low = self.current.num_speculative_tokens, self.params.bounds.k[0]
        acc = obs.accepted_per_pos
        if k <= max(1, low) or len(acc) < k or acc[k - 1] >= self.params.down_probe_acceptance * 2 / 3:
            return None
        kept = max([i + 1 for i in range(k) if acc[i] >= self.params.down_probe_acceptance], default=1)
        new_k = max(kept, low, 1, k - self.params.limits.max_k_step)
        down = TunedConfig(new_k, self.current.max_num_seqs, self.current.max_num_batched_tokens)
        if self._tabooed(down, obs.demand, now):
            return None
        return down, (f"probing a shorter draft: its last position is accepted only {acc[k - 1]:.0%} of the "
                      "time, and what a rarely accepted draft token costs (a longer verification, the "
                      "proposer's work) is below what the step-cost model resolves")

    def _load_shift(self, now: float, obs: Observation) -> Decision | None:
        """The load moved within the window (the gauges' count now is far from the window's mean): its
        figures mix two loads, so hold until a window at one load, except where the knee decides alone:
        a load that rose past it with speculation on, where every proposed token costs compute (at
        concurrency 32 a draft of 6 cut goodput to 0.4x on 2 CPU cores), turns speculation off now; one
        that fell under it (at this interval and the one before) with speculation off turns it on, if
        the model predicts a gain at the new load. The search takes over at the first clean window. A
        shift that outlasts `shift_hold_s` (a window shorter than the requests makes the mean jumpy) is
        taken as the load."""
        assert self.current is not None
        p = self.params
        before, after = obs.demand, obs.in_system_now
        previous, self.load_now_before = self.load_now_before, after
        if before is None or after is None or abs(after - before) < max(4.0, 0.5 * max(before, after)):
            self.shift_since = None
            return None
        self.shift_since = now if self.shift_since is None else self.shift_since
        if now - self.shift_since > (p.shift_hold_s if p.shift_hold_s is not None else 2 * p.window_s):
            return None
        what = f"load shifting: {after:.0f} requests in the system now against {before:.1f} over the window"
        batch, knee = min(after / obs.engines, float(self.current.max_num_seqs)), self._knee()
        off = self.current.with_(num_speculative_tokens=0)
        if self.current.num_speculative_tokens > 0 and p.bounds.k[0] == 0 and batch >= knee and \
                not self._tabooed(off, after, now):
            self.probation = None  # the load it would be judged at is gone
            return self._change(now, off, "change", f"{self.current.short()} -> {off.short()}: {what}; "
                                f"{batch:.0f} sequences per step are past the step cost's knee ({knee:.0f} "
                                "tokens), where speculation costs compute: off now, searched afresh at the "
                                "first window at the new load", probation=False)
        # on only when the count was low at the previous interval too: under a heavy closed loop requests
        # finish in waves, and one scrape can land in the trough of one
        on = None if previous is None else self._speculation_on_at(obs, max(after, previous), knee, now)
        if on is not None:
            config, gain = on
            self.probation = None
            load = max(after, previous or 0.0)
            decision = self._change(now, config, "change", f"{self.current.short()} -> {config.short()}: "
                                    f"{what}; {batch:.0f} sequences per step are under the step cost's knee "
                                    f"({knee:.0f} tokens) with speculation off: predicted goodput {gain:+.0%} "
                                    "at the new load; on now, searched afresh at the first window at the new "
                                    "load", probation=False)
            self.guard = self._guard_at(load, obs.engines)
            return decision
        return self._hold(now, "hold", f"{what}; holding {self.current.short()} until a window at one load")

    @property
    def manages_guard(self) -> bool:
        """Whether the engines' speculative_disable_by_batch_size is the policy's to set (not with k pinned
        to 0: there is nothing to disable)."""
        return self.params.guard and self.params.bounds.k[1] > 0

    def _guard_at(self, load: float, engines: int) -> int:
        """`speculative_disable_by_batch_size` at `load` requests in the system, spread over `engines`: one
        under the smallest batch at which `_load_shift` would turn speculation off (a rise to at least
        twice the load and 4 more requests, at or past the knee), so the engine does at its next step what
        the tuner would do at its next interval. 0 (never) when that batch is past max_num_seqs, or with
        `guard` off."""
        assert self.current is not None
        if not self.manages_guard:
            return 0
        off_at = max(math.ceil(self._knee()), math.ceil((load + 4) / engines), math.ceil(2 * load / engines))
        return 0 if off_at > self.current.max_num_seqs else off_at - 1

    def _speculation_on_at(self, obs: Observation, load: float, knee: float,
                           now: float) -> tuple[TunedConfig, float] | None:
        """The mirror of turning speculation off on a rise: the load fell under the knee (memory-bound,
        where drafts are cheap) with k = 0. The k the model predicts best at the new load (acceptance as
        remembered for such a load, else the prior), if it clears the dead band; None otherwise."""
        assert self.current is not None
        p = self.params
        if self.current.num_speculative_tokens > 0 or p.bounds.k[1] == 0 or load < 1.0 or \
                min(load / obs.engines, float(self.current.max_num_seqs)) >= knee:
            return None
        model = self._model(replace(obs, running=load, waiting=0.0))
        if model is None:
            return None
        here = model.predict(self.current).throughput
        options = [c for c in candidates(self.current, obs, p.slo, p.bounds, p.limits)
                   if c.num_speculative_tokens > 0 and c.max_num_seqs == self.current.max_num_seqs
                   and not self._tabooed(c, load, now)]
        best = max(options, key=lambda c: model.predict(c).throughput, default=None)
        if best is None or here <= 0:
            return None
        gain = model.predict(best).throughput / here - 1.0
        return (best, gain) if gain > p.dead_band else None

    def rejected(self, now: float, config: TunedConfig, error: str) -> Decision:
        """The engines refused `config` (a ceiling the bounds did not know): go back and never retry it."""
        previous = self.before_change if self.current == config else self.current
        self.probation = None
        self.taboo += [(knob, (value, value), None, float("inf")) for knob, value in config.as_admin().items()
                       if (self.before_change is None or self.before_change.as_admin()[knob] != value)]
        if previous is None or previous == config:
            return Decision(now, None, f"engines refused {config.short()}: {error}", "hold")
        self.current = previous
        self.last_change = now
        return Decision(now, previous, f"engines refused {config.short()}: {error}; back to {previous.short()}",
                        "revert")

    # -- model -------------------------------------------------------------------------------------

    def _learn(self, obs: Observation) -> None:
        if obs.step_duration_s and obs.batch_size and obs.step_rate:
            drafted = (obs.draft_token_rate or 0.0) / obs.step_rate
            prefill = (obs.prompt_rate or 0.0) / obs.step_rate
            self.cost_points.append((obs.batch_size + drafted, prefill, obs.step_duration_s))
            if not drafted:
                self.plain_cost_points.append((obs.batch_size, prefill, obs.step_duration_s))
        share = obs.proposal_share
        if share is not None and obs.accepted_per_pos:
            self.acceptance.append((obs.demand, tuple(obs.accepted_per_pos), share, obs.time))

    def _model(self, obs: Observation) -> LoadModel | None:
        cost = fit_step_cost(list(self.cost_points))
        if cost is None or obs.demand is None:
            return None
        per_pos: tuple[float, ...] = ()
        share = 0.8  # with the prior acceptance (goodput.PRIOR_ACCEPTANCE)
        for demand, pos, seen_share, seen_at in reversed(self.acceptance):
            if seen_at == obs.time or (obs.time - seen_at <= self.params.acceptance_ttl_s
                                       and _similar(demand, obs.demand)):
                per_pos, share = pos, seen_share
                break
        prefill = (obs.prompt_rate or 0.0) / obs.generation_rate if obs.generation_rate else 0.0
        return LoadModel(max(obs.demand / obs.engines, 1.0), per_pos, share, prefill, cost)

    def _tabooed(self, config: TunedConfig, demand: float | None, now: float) -> bool:
        self.taboo = [t for t in self.taboo if t[3] > now]
        values = config.as_admin()
        return any(low <= values[knob] <= high and _similar(d, demand) for knob, (low, high), d, _ in self.taboo)

    # -- outputs -----------------------------------------------------------------------------------

    @staticmethod
    def _ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"

    def _figures(self, obs: Observation, goodput: float | None, share: float | None) -> str:
        acc = obs.acceptance_rate
        return (f"observed goodput {'n/a' if goodput is None else f'{goodput:.1f}'} tok/s, "
                f"SLO attainment {'n/a' if share is None else f'{share:.0%}'}, "
                f"TPOT p95 {self._ms(obs.tpot_p95_s)}, TTFT p95 {self._ms(obs.ttft_p95_s)}, "
                f"in system {obs.demand or 0:.1f}, acceptance {'n/a' if acc is None else f'{acc:.2f}'}")

    def _hold(self, now: float, kind: str, why: str, goodput: float | None = None,
              share: float | None = None) -> Decision:
        held = self.current
        suffix = f"; holding {held.short()} (fail static)" if kind == "missing" and held is not None else ""
        return Decision(now, None, why + suffix, kind, observed_goodput=goodput, slo_attainment=share)

    def _change(self, now: float, config: TunedConfig, kind: str, reason: str, *, probation: bool = True,
                goodput: float | None = None, share: float | None = None, predicted: float | None = None,
                demand: float | None = None, probe: bool = False) -> Decision:
        previous = self.before_change = self.current
        if probation and previous is not None:
            self.probation = _Probation(previous, config, goodput, share, demand, now, probe)
        self.current = config
        self.last_change = now
        return Decision(now, config, reason, kind, predicted, goodput, share)
