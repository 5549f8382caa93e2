"""The policy's state machine between intervals: the config in force and the last good one, the cooldown
after a change, the probation that judges it, the taboo list of moves measured worse, and the load shift
being waited out. Plain data and the rules that read it; the wording is in `reasons.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..types import Observation, TunedConfig
from .load import shifting, similar
from .params import PolicyParams

Span = tuple[float, float]  # [low, high] of a knob's values


@dataclass
class Probation:
    """A change waiting for its first clean window, with what was measured before it."""

    previous: TunedConfig
    tried: TunedConfig
    baseline_goodput: float | None
    baseline_attainment: float | None
    baseline_demand: float | None
    since: float
    probe: bool = False  # a measurement the model could not make (see probes.py)

    def lost(self, goodput: float | None, params: PolicyParams) -> bool:
        """Goodput fell by more than the revert margin."""
        return (
            goodput is not None
            and self.baseline_goodput is not None
            and goodput < self.baseline_goodput * (1.0 - params.revert_margin)
        )

    def missed(self, share: float | None, params: PolicyParams) -> bool:
        """SLO attainment fell by more than the revert margin (in points)."""
        return (
            share is not None
            and self.baseline_attainment is not None
            and share < self.baseline_attainment - params.revert_margin
        )


def directions(before: TunedConfig, after: TunedConfig) -> list[tuple[str, Span]]:
    """The moves a change made, as value ranges not to try again: raising k from 2 to 4 made things
    worse, so no k above 2 (at this load) either."""
    old, new = before.as_admin(), after.as_admin()
    spans: list[tuple[str, tuple[float, float]]] = []
    for knob, value in new.items():
        if value > old[knob]:
            spans.append((knob, (old[knob] + 1, float("inf"))))
        elif value < old[knob]:
            spans.append((knob, (float("-inf"), old[knob] - 1)))
    return spans


@dataclass
class Taboo:
    """Knob values not to try: (knob, [low, high], the load it was judged at (None: any), until when)."""

    entries: list[tuple[str, Span, float | None, float]] = field(default_factory=list)

    def forbid(self, before: TunedConfig, after: TunedConfig, demand: float | None, until: float) -> None:
        """The move from `before` to `after`, at loads like `demand`, until `until`."""
        self.entries += [(knob, span, demand, until) for knob, span in directions(before, after)]

    def refuse(self, config: TunedConfig, before: TunedConfig | None) -> None:
        """Each value of `config` that differs from `before`, at any load, for ever (an engine refused it)."""
        self.entries += [
            (knob, (value, value), None, float("inf"))
            for knob, value in config.as_admin().items()
            if before is None or before.as_admin()[knob] != value
        ]

    def covers(self, config: TunedConfig, demand: float | None, now: float, params: PolicyParams) -> bool:
        self.entries = [t for t in self.entries if t[3] > now]
        values = config.as_admin()
        return any(
            low <= values[knob] <= high and similar(d, demand, params)
            for knob, (low, high), d, _ in self.entries
        )


@dataclass
class Level:
    """The load level the policy is at, and the config changes made since it began (churn): a level begins
    at a load shift's first window, or when a clean window's load has moved from the level's as far as a
    shift (`load.shifting`: a drift the shift rule did not see within one window). Not at a load merely
    unlike the level's (`similar`): a closed loop at concurrency 2 reads 1.1 to 2.2 from window to window,
    and each such reading would renew the budget (docs/decisions/006-churn-budget.md).
    After a shift the windows' mean lags the load by up to a window, so the level's load is read from the
    first window that begins after the shift."""

    demand: float | None = None  # requests in the system at the level (None: not read yet)
    since: float | None = None
    changes: int = 0
    most: int = 0  # the most changes any level has seen
    settled: bool = False  # `demand` read from a window wholly inside the level

    def begin(self, now: float, demand: float | None, settled: bool = False) -> None:
        self.demand, self.since, self.changes, self.settled = demand, now, 0, settled

    def follow(self, now: float, demand: float | None, params: PolicyParams) -> None:
        """A clean window (one load): a load no longer like the level's begins a new level."""
        if self.since is None:
            self.begin(now, demand, settled=True)
        elif not self.settled:
            if now - self.since >= params.window_s:  # the window no longer holds the load before the shift
                self.demand, self.settled = demand, True
        elif demand is not None and self.demand is not None and shifting(self.demand, demand, params):
            self.begin(now, demand, settled=True)
        elif self.demand is None:
            self.demand = demand

    def count(self) -> None:
        self.changes += 1
        self.most = max(self.most, self.changes)

    def room(self, changes: int, params: PolicyParams) -> bool:
        """Whether `changes` more (a change and the revert it may need: 2) stay within the budget."""
        return self.changes + changes <= params.max_changes_per_load


@dataclass
class Shift:
    """The load shift being waited out: when it was first seen, and the gauges' count at the last interval."""

    since: float | None = None
    count_before: float | None = None

    def see(
        self, now: float, obs: Observation, params: PolicyParams
    ) -> tuple[float, float, float | None] | None:
        """(the window's mean, the count now, the count at the previous interval) while the load is
        shifting and the hold has not outlasted `shift_hold_s`; None when the window is at one load."""
        before, after = obs.demand, obs.in_system_now
        previous, self.count_before = self.count_before, after
        if before is None or after is None or not shifting(before, after, params):
            self.since = None
            return None
        self.since = now if self.since is None else self.since
        if now - self.since > params.shift_hold_s:
            return None
        return before, after, previous
