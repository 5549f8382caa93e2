"""Churn: config changes per load level, reverts and reverted probes included, stay within the policy's
budget (2), however the load moves, and the count reaches the decision (status.tuning.changesThisLoad)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.tuner.policy import Policy, PolicyParams
from specfleet.tuner.policy.state import Level
from specfleet.tuner.types import SLO, Decision, TuneBounds, TunedConfig

from .plant import CPU_2CORES, GPU_LIKE, Plant, StepTable

INTERVAL = 10.0
PARAMS = PolicyParams(
    slo=SLO(ttft_p95_s=2.0, tpot_p95_s=0.2),
    bounds=TuneBounds(k=(0, 8), max_num_seqs=(4, 64), max_num_batched_tokens=(256, 4096)),
    window_s=INTERVAL,
    interval_s=INTERVAL,
)
# A dead band no prediction clears (for the start's inherited config too), so that only the probes move k
# (the probes are what gets reverted).
DEAF = replace(
    PARAMS,
    slo=SLO(ttft_p95_s=60.0, tpot_p95_s=5.0),
    bounds=TuneBounds(k=(0, 8), max_num_seqs=(32, 32)),
    dead_band=10.0,
    inherited_band=10.0,
)
RARE_LAST = dict(per_pos=(0.3, 0.2, 0.05, 0.03), spec_overhead=0.005)  # a shorter-draft probe fires here


def run_levels(policy: Policy, start: TunedConfig, levels: list[Plant], windows: int) -> list[list[Decision]]:
    """Closed loop over load levels; each level's first window still holds the previous load (the gauges
    already read the new one), and its second is half way, as a real rate window lags a step in load.
    The decisions per level."""
    config, t, out, previous = start, 0.0, [], None
    for plant in levels:
        decisions = []
        for i in range(windows):
            source = plant
            if previous is not None and i == 0:  # the window still holds the load before
                source = replace(previous, demand_now=plant.demand)
            elif previous is not None and i == 1:  # the window's mean half way, as a rate window lags
                source = replace(plant, demand=(previous.demand + plant.demand) / 2, demand_now=plant.demand)
            decision = policy.decide(source.observe(t, config))
            decisions.append(decision)
            config = decision.config or config
            t += INTERVAL
        out.append(decisions)
        previous = plant
    return out


def test_a_probe_that_would_leave_no_room_for_its_revert_is_held() -> None:
    """The issue's case: one change already made at this load, then the shorter-draft probe (k 4 -> 2)
    would fire; it and its possible revert would make three, so the policy holds and says why."""
    policy = Policy(DEAF)
    plant = Plant(demand=2, **RARE_LAST)
    policy.level.begin(0.0, plant.demand)  # a load level began, and the load-shift rule turned speculation on
    policy.level.count()
    decisions = [policy.decide(plant.observe(INTERVAL * i, TunedConfig(4, 32, 1024))) for i in range(12)]
    assert not any(d.changed for d in decisions), [d.reason for d in decisions if d.changed]
    held = [d for d in decisions if "no room" in d.reason]
    assert held and "probe of k=2" in held[0].reason and "at most 2 per load level" in held[0].reason
    assert all(d.changes_this_load == 1 for d in decisions)
    # with an empty budget the same probe is made, and counted
    fresh = Policy(DEAF)
    moved = [fresh.decide(plant.observe(INTERVAL * i, TunedConfig(4, 32, 1024))) for i in range(12)]
    probe = next(d for d in moved if d.changed)
    assert "probing a shorter draft" in probe.reason and probe.changes_this_load == 1


def test_a_new_level_resets_the_count() -> None:
    level = Level()
    level.follow(0.0, 2.0, PARAMS)
    level.count()
    level.count()
    assert not level.room(1, PARAMS) and level.most == 2
    for t, wobble in enumerate((2.4, 1.1, 2.2, 1.2)):  # a closed loop at 2 reads so from window to window
        level.follow(10.0 * (t + 1), wobble, PARAMS)
    assert level.changes == 2  # the same level: its budget is spent
    level.follow(60.0, 32.0, PARAMS)  # a load moved as far as a shift: a new level (a drift the rule missed)
    assert level.changes == 0 and level.room(2, PARAMS) and level.most == 2
    # after a shift the window's mean lags: its windows do not start a level of their own until one has
    # turned over, and the level's load is read from that one
    level.begin(100.0, 24.0)
    level.count()
    level.follow(100.0 + INTERVAL / 2, 14.0, PARAMS)  # the mean still mixes the load before the shift
    assert level.changes == 1 and not level.settled
    level.follow(100.0 + INTERVAL, 23.0, PARAMS)
    assert level.changes == 1 and level.settled and level.demand == 23.0


LOADS = st.sampled_from([1.0, 2.0, 6.0, 16.0, 48.0])  # pairwise unlike (`similar_load`)
PROFILES = st.sampled_from(  # the traffic of one load level
    [
        dict(per_pos=(0.9,) * 8),
        dict(per_pos=(0.95, 0.93, 0.92, 0.9), spec_overhead=0.004),
        RARE_LAST,
        dict(per_pos=(0.3, 0.1)),
        dict(per_pos=(0.9, 0.85, 0.8, 0.75)),
        dict(per_pos=(0.4, 0.25, 0.15, 0.1)),
    ]
)
# The hardware, one per service: a step table that changed between load levels would make every window
# the fit learned from another machine's (a GPU-like level's flat floor read at batch 32 on the CPU's)
HARDWARE = st.sampled_from([CPU_2CORES, GPU_LIKE, CPU_2CORES.with_compute(1 / 3)])


@settings(max_examples=25, deadline=None)
@given(
    loads=st.lists(LOADS, min_size=2, max_size=5),
    profile=st.lists(PROFILES, min_size=5, max_size=5),
    steps=HARDWARE,
    deaf=st.booleans(),
    noise=st.sampled_from([0.0, 0.05]),
    start_k=st.sampled_from([0, 2, 4]),
)
def test_at_most_two_changes_per_load_level(
    loads: list[float], profile: list[dict], steps: StepTable, deaf: bool, noise: float, start_k: int
) -> None:
    loads = [x for i, x in enumerate(loads) if i == 0 or x != loads[i - 1]]
    levels = [Plant(demand=x, noise=noise, seed=i, steps=steps, **profile[i]) for i, x in enumerate(loads)]
    policy = Policy(DEAF if deaf else PARAMS)
    per_level = run_levels(policy, TunedConfig(start_k, 32, 1024), levels, windows=15)
    counts = [sum(d.changed for d in decisions) for decisions in per_level]
    assert max(counts) <= 2, [[d.reason for d in ds if d.changed] for ds in per_level]
    assert policy.level.most <= 2
    for decisions in per_level:  # the count each decision carries is the changes so far at this load
        changed = [d for d in decisions if d.changed]
        assert all(d.changes_this_load is not None and d.changes_this_load <= 2 for d in decisions)
        if changed:
            assert changed[-1].changes_this_load is not None and changed[-1].changes_this_load >= 1
