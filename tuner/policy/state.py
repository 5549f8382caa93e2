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
