"""Every number the policy decides with, each beside its measurement or its reason.

`PolicyParams` is what a service's tuner runs with (built from the spec by `loop.params_from_spec`);
`StepLimits` bounds one change (the search's step); `ModelParams` is the goodput model's priors and
what it learns from. Nothing else in the policy holds a tunable number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..types import SLO, TuneBounds


@dataclass(frozen=True)
class StepLimits:
    """How far one change moves each knob (the search's candidates, `candidates.py`)."""

    # k moves at most this much per change (turning speculation off is one step): 4 reaches a typical
    # useful k (4-6) from off in one change, where a load shift leaves a minute or two to win back
    max_k_step: int = 4
    max_seqs_factor: float = 2.0  # max_num_seqs at most doubles or halves per change
    # and the steps between: the TPOT target often binds between two powers of two, where halving or
    # doubling would overshoot it on one side
    seqs_factors: tuple[float, ...] = (0.75, 1.5)
    # max_num_batched_tokens grows by this factor while TTFT misses its target with TPOT to spare and
    # requests wait (more prefill per step), and shrinks by the other while TPOT misses on a load with more
    # prompt than output tokens (less prefill riding on each decode step): one step of the seqs ladder
    budget_grow: float = 1.5
    budget_shrink: float = 0.75
    # "TPOT to spare": its p95 under this share of the target, so that the extra prefill per step (a step
    # grows by about c1 per prompt token) does not push it over the target in the same change
    tpot_spare: float = 0.7
    # room for every sequence's decode and draft tokens grows the budget at most by this factor per change
    # (a budget that cannot hold them only makes the scheduler split the batch, which the model does not see)
    budget_room_factor: float = 2.0


@dataclass(frozen=True)
class ModelParams:
    """The goodput model's priors and the fit's rules (`model.py`), and how much it remembers (`memory.py`)."""

    # c1/c0 of the step cost before the observed points span enough tokens per step to fit both: the
    # bundled 135M model on a 2-core CPU, the knee at 6 tokens (docs/decisions/001-step-cost-model.md).
    # GPUs have a far smaller ratio (a knee at hundreds of tokens), which only makes the prior
    # conservative about speculation there.
    prior_cost_ratio: float = 1 / 6
    # per-position acceptance before any draft was verified at a load like the one now (n-gram on chat
    # text): low, so that speculation is tried where it is cheap (under the knee) and nowhere else
    prior_acceptance: tuple[float, ...] = (0.5, 0.35, 0.25, 0.18, 0.13, 0.1, 0.07, 0.05)
    # share of sequence-steps that carry a draft, with the prior acceptance (n-gram finds no match on some
    # steps); no windows with drafts exist yet to measure it
    prior_proposal_share: float = 0.8
    # positions past those measured decay geometrically at the ratio of the last two measured, capped here
    # (acceptance never grows with the position), or at `decay_ratio` when only one position is measured
    decay_ratio: float = 0.7
    max_decay_ratio: float = 0.9
    # the fit replaces the prior ratio only from at least this many points spanning at least this factor
    # in decode tokens per step (one regime alone cannot tell the floor from the slope), and only if its
    # squared relative error is under this share of the prior's (clearly better, not a noise pick)
    fit_min_points: int = 3
    fit_min_span: float = 2.0
    fit_min_gain: float = 0.8
    # windows of step-cost points kept for the fit: 20 minutes at the default 30 s interval, long enough to
    # hold several loads (both sides of the knee), short enough that a slowed machine ages out
    cost_windows: int = 40
    # windows of acceptance kept: more than `PolicyParams.acceptance_ttl_s` holds at the default interval
    # (300 s / 30 s = 10), so the TTL, not the length, bounds what is remembered
    acceptance_windows: int = 16


@dataclass(frozen=True)
class PolicyParams:
    slo: SLO
    bounds: TuneBounds = field(default_factory=TuneBounds)
    window_s: float = 30.0  # rate window of the observations
    interval_s: float = 30.0
    # A change must promise this much more goodput (docs/decisions/003-dead-band-and-inherited-band.md) ...
    dead_band: float = 0.10
    # ... unless the config in force was inherited: set before this load level began (the spec's, or the one
    # chosen for the load before) and unchanged since. The dead band guards a config chosen at this load
    # against a model's noise; an inherited one has no such claim, and what the move risks, probation still
    # judges (docs/decisions/003-dead-band-and-inherited-band.md).
    inherited_band: float = 0.05
    revert_margin: float = 0.05  # a change that lost this much goodput (or attainment) is reverted
    slo_headroom: float = 0.9  # candidates must keep predicted TPOT p95 under this share of the target
    taboo_s: float = 600.0  # a reverted config is not retried at a similar load for this long
    # acceptance measured while k > 0 is trusted this long once k = 0, and only at a similar load (a load
    # that moved is often other traffic: grounded prompts at concurrency 1, chat at 32)
    acceptance_ttl_s: float = 300.0
    min_demand: float = 0.05  # below this (requests in the system) the service counts as idle
    limits: StepLimits = field(default_factory=StepLimits)
    model: ModelParams = field(default_factory=ModelParams)
    up_probe_acceptance: float = (
        0.5  # raise k as a measurement while its last position is accepted this often
    )
    # drop, as a measurement, the last positions accepted less often than this, when the last one is
    # accepted less than `down_probe_start` times as often (hysteresis: a position near the line is not
    # probed twice: 8% decides what to drop, 5.3% starts a probe). Both under the break-even, where a probe
    # measures only noise: see docs/decisions/005-shorter-draft-probe-lines.md
    down_probe_acceptance: float = 0.08
    down_probe_start: float = 2 / 3
    # Two loads are "similar" (a probation's comparison holds, acceptance and taboos carry over) when
    # their requests in the system differ by at most this share of the larger (and of 1 request): the bench's
    # phases, concurrency 1, 2 and 32, are each other's "other" load, while one closed loop's mean,
    # which moves by a few tenths between windows as requests finish in waves, stays one load
    similar_load: float = 0.4
    # Among candidates of near-equal predicted goodput the one changing fewer knobs wins: each knob changed
    # costs this share of its goodput, far under the dead band, so it only breaks near-ties
    change_penalty: float = 0.02
    # A load shift: the gauges' count now differs from the window's mean by at least this many requests
    # and by at least this share of the larger. A closed loop at one concurrency reads within a few
    # requests of its mean, and a shift of half the load is what the knee rules act on (at concurrency 32
    # a draft of 6 cut goodput to 0.4x on 2 CPU cores; at 1 or 2, speculation pays)
    shift_requests: float = 4.0
    shift_share: float = 0.5
    # hold through a load shift at most this many windows: a "shift" that outlasts them is the load (a
    # window shorter than the requests makes the mean jumpy); two, so one wave's trough is not taken
    shift_hold_windows: float = 2.0
    # The fall rule turns speculation on with the shortest draft predicted within this share of the best.
    # It decides on acceptance not yet measured at the new load (the prior, or what a similar load showed)
    # and its choice holds for the level (the churn budget leaves no room for a judged change after it),
    # where the model errs toward longer drafts (the roofline underprices a step's extra tokens at small
    # batches). Half the dead band: a tie the model cannot resolve, not a gain it predicts. See
    # docs/decisions/004-fall-rule-shortest-draft.md.
    shift_on_tie: float = 0.05
    guard: bool = True  # keep the engines' speculative_disable_by_batch_size at the load-shift rule's batch
    # Config changes per load level, reverts and reverted probes included: more than two after one load
    # change is flapping on an SRE's dashboard (docs/decisions/006-churn-budget.md). A change that
    # probation may revert needs room for its
    # revert too; the load-shift rules (step 3, not judged) and a change made while TPOT misses its target
    # (the SLO first; its revert, if the model was wrong, may be a third) need room for one.
    max_changes_per_load: int = 2

    @property
    def cooldown_s(self) -> float:
        """A change is applied right after the scrape that decided it, so a rate window ending this long
        later holds only samples taken under it."""
        return self.window_s

    @property
    def shift_hold_s(self) -> float:
        return self.shift_hold_windows * self.window_s
