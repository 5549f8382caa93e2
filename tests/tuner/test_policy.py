"""The policy on synthetic observation sequences: the directions it moves, its guardrails, its bounds."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from specfleet.tuner.policy import Policy, PolicyParams
from specfleet.tuner.types import SLO, Decision, Observation, TuneBounds, TunedConfig

from .plant import CPU_2CORES, GPU_LIKE, Plant

INTERVAL = 10.0
SLO_CPU = SLO(ttft_p95_s=2.0, tpot_p95_s=0.2)
PARAMS = PolicyParams(
    slo=SLO_CPU,
    bounds=TuneBounds(k=(0, 8), max_num_seqs=(4, 64), max_num_batched_tokens=(256, 4096)),
    window_s=INTERVAL,
    interval_s=INTERVAL,
)


def run(
    plant: Plant, policy: Policy, start: TunedConfig, steps: int, t0: float = 0.0
) -> tuple[TunedConfig, list[Decision]]:
    """Closed loop: the plant runs the policy's last config; returns the final config and every decision."""
    config = start
    decisions = []
    for i in range(steps):
        decision = policy.decide(plant.observe(t0 + i * INTERVAL, config))
        decisions.append(decision)
        if decision.config is not None:
            config = decision.config
    return config, decisions


def changes(decisions: list[Decision]) -> list[Decision]:
    return [d for d in decisions if d.changed]


def test_low_load_with_high_acceptance_raises_k() -> None:
    start = TunedConfig(0, 16, 512)
    final, decisions = run(Plant(demand=1), Policy(PARAMS), start, 12)
    assert final.num_speculative_tokens >= 4, [d.reason for d in decisions]
    first = changes(decisions)[0]
    assert first.config is not None and 0 < first.config.num_speculative_tokens <= 4  # bounded step
    assert "goodput" in first.reason


def test_high_load_turns_speculation_off() -> None:
    start = TunedConfig(4, 64, 2048)
    final, decisions = run(
        Plant(demand=48, steps=CPU_2CORES.with_compute(1 / 3), per_pos=(0.4, 0.25, 0.15, 0.1)),
        Policy(PARAMS),
        start,
        6,
    )
    assert final.num_speculative_tokens == 0, [d.reason for d in decisions]
    assert len(changes(decisions)) <= 2


# An SLO every config meets, so that goodput is throughput and only the probe's measurement decides.
LOOSE = PolicyParams(
    slo=SLO(ttft_p95_s=60.0, tpot_p95_s=5.0),
    bounds=TuneBounds(k=(0, 8), max_num_seqs=(32, 32)),
    window_s=INTERVAL,
    interval_s=INTERVAL,
)


def test_high_load_probes_speculation_off_when_the_draft_cost_is_invisible() -> None:
    """A draft model that agrees 95% but costs its own passes: the target-step model calls k=2 a wash at
    batch 32; the probe measures k=0, keeps it, and does not go back at that load."""
    plant = Plant(demand=32, per_pos=(0.95, 0.93, 0.92, 0.9), spec_overhead=0.004)
    final, decisions = run(plant, Policy(LOOSE), TunedConfig(2, 32, 1024), 20)
    assert final.num_speculative_tokens == 0, [d.reason for d in decisions]
    moved = changes(decisions)
    assert len(moved) == 1 and "probing speculation off" in moved[0].reason, [d.reason for d in moved]
    assert (
        plant.observe(0, final).generation_rate > plant.observe(0, TunedConfig(2, 32, 1024)).generation_rate
    )


def test_no_probe_at_low_load_even_when_the_draft_makes_steps_look_compute_bound() -> None:
    """At batch 1 a draft's passes make the step grow with k as if compute-bound; the knee for probing is
    taken from windows without proposals, so speculation stays on."""
    plant = Plant(demand=1, per_pos=(0.95, 0.93, 0.92, 0.9), spec_overhead=0.004)
    final, decisions = run(plant, Policy(LOOSE), TunedConfig(0, 32, 1024), 20)
    assert final.num_speculative_tokens >= 2, [d.reason for d in decisions]
    assert not any("probing speculation off" in d.reason for d in changes(decisions))


def test_a_probe_that_loses_is_reverted() -> None:
    """Hardware whose knee lies far above the prior's (GPU-like: compute per token tiny next to the
    weights' traffic), so speculation still pays at batch 32: the probe loses, is reverted, and is not
    tried again at that load."""
    plant = Plant(demand=32, per_pos=(0.9, 0.85, 0.8, 0.75), steps=GPU_LIKE)
    final, decisions = run(plant, Policy(LOOSE), TunedConfig(2, 32, 1024), 20)
    kinds = [d.kind for d in changes(decisions)]
    assert final.num_speculative_tokens >= 2 and kinds[:2] == ["change", "revert"], [
        d.reason for d in decisions
    ]
    assert len(kinds) <= 3


# A dead band no prediction clears (for the start's inherited config too), so that only the probes move k.
DEAF = PolicyParams(
    slo=SLO(ttft_p95_s=60.0, tpot_p95_s=5.0),
    bounds=TuneBounds(k=(0, 8), max_num_seqs=(32, 32)),
    window_s=INTERVAL,
    interval_s=INTERVAL,
    dead_band=10.0,
    inherited_band=10.0,
)


def test_low_load_probes_a_longer_draft_while_its_last_position_is_accepted() -> None:
    """Batch 1, drafts accepted at every position: the probe raises k within a bounded step as far as the
    verification step stays under the knee (6 tokens, the prior's: every window carries drafts, so none
    fits the target's own step: k=5), and is kept."""
    plant = Plant(demand=1, per_pos=(0.9,) * 8)
    final, decisions = run(plant, Policy(DEAF), TunedConfig(1, 32, 1024), 20)
    moved = changes(decisions)
    assert [d.config.num_speculative_tokens for d in moved if d.config] == [5], [d.reason for d in decisions]
    assert "probing a longer draft" in moved[0].reason
    assert (
        plant.observe(0, final).generation_rate > plant.observe(0, TunedConfig(2, 32, 1024)).generation_rate
    )


def test_no_longer_draft_probe_when_the_last_position_is_rarely_accepted() -> None:
    final, decisions = run(
        Plant(demand=1, per_pos=(0.5, 0.3, 0.2, 0.1)), Policy(DEAF), TunedConfig(2, 32, 1024), 12
    )
    assert changes(decisions) == [], [d.reason for d in changes(decisions)]


def test_a_longer_draft_probe_that_loses_is_reverted_and_not_retried() -> None:
    """Drafted tokens that cost 40 ms each (a slow proposer): the longer draft measures worse than k=2."""
    plant = Plant(demand=1, per_pos=(0.9,) * 8, spec_overhead=0.04)
    final, decisions = run(plant, Policy(DEAF), TunedConfig(2, 32, 1024), 20)
    kinds = [d.kind for d in changes(decisions)]
    assert kinds == ["change", "revert"] and final.num_speculative_tokens == 2, [d.reason for d in decisions]


def test_rarely_accepted_last_positions_are_probed_off() -> None:
    """Concurrency 2 with k=4: positions 2 and 3 are accepted 5% and 3% of the time, and each drafted
    token costs 5 ms the step model does not see: the probe drops them and keeps k=2."""
    plant = Plant(demand=2, per_pos=(0.3, 0.2, 0.05, 0.03), spec_overhead=0.005)
    final, decisions = run(plant, Policy(DEAF), TunedConfig(4, 32, 1024), 20)
    moved = changes(decisions)
    assert len(moved) == 1 and "probing a shorter draft" in moved[0].reason, [d.reason for d in moved]
    assert final.num_speculative_tokens == 2
    assert (
        plant.observe(0, final).generation_rate > plant.observe(0, TunedConfig(4, 32, 1024)).generation_rate
    )
    # a last position near the line (7%: under the 8% that decides what to drop, over the 5.3% that
    # starts a probe) is left alone, so a kept probe is not followed by another
    _, decisions = run(Plant(demand=2, per_pos=(0.3, 0.07)), Policy(DEAF), TunedConfig(2, 32, 1024), 10)
    assert changes(decisions) == [], [d.reason for d in changes(decisions)]


def test_load_rising_past_the_knee_turns_speculation_off_at_once() -> None:
    """The window still holds the low load (1 in the system on average) but 32 requests are in the
    system now: speculation goes off on this interval, before a window at the new load exists."""
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=1), policy, TunedConfig(0, 32, 1024), 12)
    assert settled.num_speculative_tokens >= 2
    decision = policy.decide(Plant(demand=1, demand_now=32).observe(500.0, settled))
    assert decision.config is not None and decision.config.num_speculative_tokens == 0, decision.reason
    assert "load shifting" in decision.reason and "knee" in decision.reason


def test_load_falling_under_the_knee_turns_speculation_on_at_once() -> None:
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=32, per_pos=(0.3, 0.1)), policy, TunedConfig(0, 32, 1024), 6)
    assert settled.num_speculative_tokens == 0
    falling = Plant(demand=32, demand_now=2)
    trough = policy.decide(falling.observe(500.0, settled))  # one low count can be a wave's trough
    assert trough.config is None and "load shifting" in trough.reason, trough.reason
    decision = policy.decide(falling.observe(500.0 + INTERVAL, settled))
    assert decision.config is not None and decision.config.num_speculative_tokens > 0, decision.reason
    assert "load shifting" in decision.reason and "under the step cost's knee" in decision.reason


def test_load_falling_takes_the_shortest_draft_predicted_near_the_best() -> None:
    """The fall rule decides on acceptance not measured at the new load, and its choice holds for the
    level, so of the drafts predicted within `shift_on_tie` of the best it takes the shortest: here the
    model puts k=3 a few percent ahead of k=2 (a tie it cannot resolve), and k=2 is what it turns on."""
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=32, per_pos=(0.3, 0.1)), policy, TunedConfig(0, 32, 1024), 6)
    falling = Plant(demand=32, demand_now=2)
    policy.decide(falling.observe(500.0, settled))
    obs = falling.observe(500.0 + INTERVAL, settled)
    model = policy.memory.model_at(obs, 2.0, PARAMS)
    assert model is not None
    predicted = {k: model.predict(settled.with_(num_speculative_tokens=k)).throughput for k in range(1, 5)}
    near = [k for k, t in predicted.items() if t >= (1.0 - PARAMS.shift_on_tie) * max(predicted.values())]
    assert max(predicted, key=lambda k: predicted[k]) > min(near), predicted  # the case: a near-tie

    decision = policy.decide(obs)

    assert decision.config is not None and decision.config.num_speculative_tokens == min(near), (
        decision.reason
    )
    gain = predicted[min(near)] / model.predict(settled).throughput - 1.0
    assert f"{gain:+.0%}" in decision.reason  # the gain quoted is the chosen draft's


@pytest.mark.parametrize("pods", [1, 2])
def test_guard_is_the_rise_rule_moved_into_the_engine(pods: int) -> None:
    """`guard` (the engines' speculative_disable_by_batch_size) is the largest batch per engine at which
    the load-shift rule would leave speculation on: one request more per engine and the tuner turns it
    off, so the engine doing it at its next step anticipates the tuner's next interval and nothing else."""
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=pods, pods=pods), policy, TunedConfig(0, 32, 1024), 12)
    assert settled.num_speculative_tokens >= 2 and 0 < policy.guard < 32, policy.guard
    for load, off in ((policy.guard, False), (policy.guard + 1, True)):
        probe = copy.deepcopy(policy)
        decision = probe.decide(Plant(demand=pods, pods=pods, demand_now=load * pods).observe(500.0, settled))
        turned_off = decision.config is not None and decision.config.num_speculative_tokens == 0
        assert turned_off == off, (load, decision.reason)
    held = policy.guard
    policy.decide(Plant(demand=pods, pods=pods, demand_now=12 * pods).observe(500.0, settled))
    assert policy.guard == held  # a shifting window says nothing about the load: the guard stays


def test_guard_off_where_it_cannot_trip_or_is_not_wanted() -> None:
    busy = Policy(PARAMS)
    run(Plant(demand=48, per_pos=(0.3, 0.1)), busy, TunedConfig(0, 32, 1024), 6)
    assert busy.guard == 0  # the batch cannot reach twice 48
    unmanaged = Policy(
        PolicyParams(slo=SLO_CPU, bounds=PARAMS.bounds, window_s=INTERVAL, interval_s=INTERVAL, guard=False)
    )
    run(Plant(demand=1), unmanaged, TunedConfig(0, 32, 1024), 12)
    assert unmanaged.guard == 0


def test_load_falling_sets_the_guard_with_speculation() -> None:
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=32, per_pos=(0.3, 0.1)), policy, TunedConfig(0, 32, 1024), 6)
    assert policy.guard == 0
    falling = Plant(demand=32, demand_now=2)
    policy.decide(falling.observe(500.0, settled))
    decision = policy.decide(falling.observe(500.0 + INTERVAL, settled))
    assert decision.config is not None and decision.config.num_speculative_tokens > 0, decision.reason
    assert 0 < policy.guard < 32


@pytest.mark.parametrize("demand", [2, 6, 24, 64])
def test_replicas_share_the_load(demand: int) -> None:
    """Two engines with twice the requests behave like one engine with the load of one: the batch, the
    knee and the model are per engine, the counts the sources report are sums."""
    one, two = Policy(PARAMS), Policy(PARAMS)
    alone, _ = run(Plant(demand=demand / 2), one, TunedConfig(2, 16, 1024), 12)
    pair, _ = run(Plant(demand=demand, pods=2), two, TunedConfig(2, 16, 1024), 12)
    assert pair == alone


def test_load_shift_holds_until_a_window_at_one_load() -> None:
    """48 in the system falling to 12: still past the knee, so nothing to do before a window at 12."""
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=48, per_pos=(0.3, 0.1)), policy, TunedConfig(0, 32, 1024), 6)
    falling = Plant(demand=48, demand_now=12, per_pos=(0.3, 0.1))
    held = [policy.decide(falling.observe(500.0 + i * INTERVAL, settled)) for i in range(2)]
    assert all(d.config is None and "load shifting" in d.reason for d in held), [d.reason for d in held]
    # a "shift" that outlasts two windows is the load (a window shorter than the requests makes the mean jumpy)
    later = policy.decide(falling.observe(500.0 + 3 * INTERVAL, settled))
    assert "load shifting" not in later.reason


def test_acceptance_measured_at_another_load_is_not_assumed() -> None:
    """Grounded prompts at concurrency 1 accept 95% of drafts; chat at 32 turns speculation off; chat at
    concurrency 2 is other traffic: the tuner starts from the prior, not from the grounded figures (with
    them it would step straight to k=4). Concurrency 2, not 3: on the measured step table a draft at
    batch 3 lands past the 5-token step (21.6 ms -> 30 ms at 8), where every k > 0 loses with chat's
    acceptance, and the tuner rightly changes nothing there."""
    policy = Policy(PARAMS)
    grounded, _ = run(Plant(demand=1, per_pos=(0.95,) * 8), policy, TunedConfig(0, 32, 1024), 12)
    assert grounded.num_speculative_tokens >= 4
    off, _ = run(Plant(demand=32, per_pos=(0.2, 0.1)), policy, grounded, 6, t0=200.0)
    assert off.num_speculative_tokens == 0
    chat = Plant(demand=2, per_pos=(0.3, 0.2, 0.1, 0.05))
    _, decisions = run(chat, policy, off, 3, t0=300.0)
    first = changes(decisions)[0]
    assert first.config is not None and first.config.num_speculative_tokens <= 2, first.reason
    # the grounded figures are still there for a load like theirs
    fresh = Policy(PARAMS)
    run(Plant(demand=1, per_pos=(0.95,) * 8), fresh, TunedConfig(0, 32, 1024), 12)
    model = fresh.model(Plant(demand=1.2).observe(140.0, TunedConfig(0, 32, 1024)))
    assert model is not None and model.per_pos[:2] == pytest.approx((0.95, 0.95))
    model = fresh.model(chat.observe(140.0, TunedConfig(0, 32, 1024)))
    assert model is not None and model.per_pos == ()


def test_the_new_traffics_shadow_drafts_outweigh_a_level_remembered_at_a_like_load() -> None:
    """bench tune's chat-c2 fall: a grounded window whose load read 1.3 counts as like 2 requests, so
    without shadow drafts the tuner took grounded's acceptance for chat's, went to a long draft and had to
    revert it; with them, the window at the fall (speculation off) measured chat's own acceptance, and
    the tuner took the short draft that chat's acceptance pays for, and kept it."""
    chat = (0.4, 0.25, 0.1, 0.05)

    def after_the_fall(shadow: bool) -> tuple[list[Decision], Policy]:
        policy = Policy(PARAMS)
        grounded = Plant(demand=1.3, per_pos=(0.95,) * 8, shadow=shadow)
        on, _ = run(grounded, policy, TunedConfig(0, 32, 1024), 12)
        off, _ = run(Plant(demand=32, per_pos=chat, shadow=shadow), policy, on, 6, t0=200.0)
        assert off.num_speculative_tokens == 0
        _, decisions = run(Plant(demand=2, per_pos=chat, shadow=shadow), policy, off, 3, t0=300.0)
        return changes(decisions), policy

    without, _ = after_the_fall(shadow=False)
    assert [d.kind for d in without] == ["change", "revert"], [d.reason for d in without]
    assert without[0].config is not None and without[0].config.num_speculative_tokens >= 4
    kept, policy = after_the_fall(shadow=True)
    assert [d.kind for d in kept] == ["change"], [d.reason for d in kept]
    assert kept[0].config is not None and 0 < kept[0].config.num_speculative_tokens <= 2
    model = policy.model(Plant(demand=2, per_pos=chat, shadow=True).observe(400.0, TunedConfig(0, 32, 1024)))
    assert model is not None and model.per_pos[0] == pytest.approx(chat[0])  # chat's, not grounded's 0.95


def test_an_inherited_config_yields_to_a_gain_under_the_dead_band() -> None:
    """Chat at concurrency 2 where a short draft is predicted +8 %: under the dead band, over
    `inherited_band`. A config nothing chose for this load (the spec's k=0 here) yields to it, and
    probation judges the move like any other; the same config chosen at this load holds."""
    chat = Plant(demand=2, per_pos=(0.22, 0.13, 0.07, 0.03), shadow=True)
    inherited = Policy(PARAMS)
    _, decisions = run(chat, inherited, TunedConfig(0, 32, 1024), 6)
    moved = changes(decisions)
    assert [d.kind for d in moved] == ["change"], [d.reason for d in decisions]
    assert moved[0].config is not None and moved[0].config.num_speculative_tokens > 0
    gain = re.search(r"predicted goodput \+(\d+)%", moved[0].reason)
    assert gain is not None and 100 * PARAMS.inherited_band < int(gain[1]) < 100 * PARAMS.dead_band
    assert inherited.probation is None  # judged at the next clean window, and kept
    chosen = Policy(PARAMS)  # k=0 chosen at this load: the change that set it came after the level began
    chosen.level.begin(0.0, chat.demand, settled=True)
    chosen.last_change = 0.0
    _, decisions = run(chat, chosen, TunedConfig(0, 32, 1024), 6, t0=INTERVAL)
    assert changes(decisions) == [], [d.reason for d in changes(decisions)]
    assert "dead band 10%" in decisions[-1].reason


def test_tpot_over_target_lowers_max_num_seqs() -> None:
    plant = Plant(demand=64)  # TPOT p95 at batch 64: ~0.45 s, over the 0.2 s target
    start = TunedConfig(0, 64, 2048)
    first = plant.observe(0.0, start)
    assert first.tpot_p95_s is not None and first.tpot_p95_s > SLO_CPU.tpot_p95_s
    final, decisions = run(plant, Policy(PARAMS), start, 8)
    assert final.max_num_seqs < 64, [d.reason for d in decisions]
    last = plant.observe(100.0, final)
    assert last.tpot_p95_s is not None and last.tpot_p95_s <= SLO_CPU.tpot_p95_s
    assert any("TPOT" in d.reason for d in changes(decisions))


@pytest.mark.parametrize("seed", range(5))
def test_noisy_steady_input_causes_no_change(seed: int) -> None:
    policy = Policy(PARAMS)
    settled, _ = run(Plant(demand=2), policy, TunedConfig(0, 16, 512), 40)
    _, decisions = run(Plant(demand=2, noise=0.05, seed=seed), policy, settled, 30, t0=1000.0)
    assert changes(decisions) == [], [d.reason for d in changes(decisions)]


def test_change_that_made_things_worse_is_reverted_and_not_retried() -> None:
    # the model expects cheap drafts; this plant charges 100 ms per drafted token
    plant = Plant(demand=1, spec_overhead=0.1)
    start = TunedConfig(0, 16, 512)
    final, decisions = run(plant, Policy(PARAMS), start, 30)
    kinds = [d.kind for d in changes(decisions)]
    assert kinds[:2] == ["change", "revert"], [d.reason for d in decisions]
    assert final == start
    revert = changes(decisions)[1]
    assert "reverted" in revert.reason and "goodput" in revert.reason
    assert len(changes(decisions)) == 2  # no flapping: the reverted config is taboo at this load


def test_missing_data_holds_config() -> None:
    policy = Policy(PARAMS)
    config, _ = run(Plant(demand=1), policy, TunedConfig(0, 16, 512), 12)
    down = Observation(time=500.0, config=None, error="Prometheus at http://p:9090 unreachable: refused")
    decision = policy.decide(down)
    assert decision.config is None and decision.kind == "missing"
    assert "unreachable" in decision.reason and config.short() in decision.reason
    empty = Observation(time=510.0, config=config, running=2.0, request_rate=1.0)  # no latencies
    decision = policy.decide(empty)
    assert decision.config is None and decision.kind == "missing"
    assert policy.current == config


def test_idle_service_holds() -> None:
    policy = Policy(PARAMS)
    idle = Observation(
        time=0.0,
        config=TunedConfig(0, 16, 512),
        running=0.0,
        waiting=0.0,
        request_rate=0.0,
        generation_rate=0.0,
        tpot_p95_s=None,
        ttft_p95_s=None,
    )
    decision = policy.decide(idle)
    assert decision.kind in {"idle", "missing"} and decision.config is None


def test_config_outside_bounds_is_moved_inside() -> None:
    decision = Policy(PARAMS).decide(Plant(demand=1).observe(0.0, TunedConfig(12, 128, 512)))
    assert decision.config is not None and PARAMS.bounds.contains(decision.config)


def test_refused_config_goes_back_and_is_never_retried() -> None:
    policy = Policy(PARAMS)
    tried = policy.decide(Plant(demand=1).observe(0.0, TunedConfig(0, 16, 512))).config
    assert tried is not None and tried.num_speculative_tokens > 0
    back = policy.rejected(1.0, tried, "num_speculative_tokens=2 must be between 0 and 0")
    assert back.config == TunedConfig(0, 16, 512) and "refused" in back.reason
    _, later = run(Plant(demand=1), policy, TunedConfig(0, 16, 512), 10, t0=100.0)
    assert all(d.config != tried for d in later)


@settings(max_examples=40, deadline=None)
@given(
    demands=st.lists(st.floats(0.0, 200.0), min_size=5, max_size=25),
    acceptance=st.floats(0.0, 1.0),
    k_bounds=st.tuples(st.integers(0, 4), st.integers(0, 8)).map(sorted),
    seq_bounds=st.tuples(st.integers(1, 64), st.integers(1, 256)).map(sorted),
    missing=st.lists(st.booleans(), min_size=25, max_size=25),
)
def test_bounds_never_crossed(
    demands: list[float], acceptance: float, k_bounds: list[int], seq_bounds: list[int], missing: list[bool]
) -> None:
    bounds = TuneBounds(k=tuple(k_bounds), max_num_seqs=tuple(seq_bounds), max_num_batched_tokens=(256, 4096))
    policy = Policy(PolicyParams(slo=SLO_CPU, bounds=bounds, window_s=INTERVAL, interval_s=INTERVAL))
    config = TunedConfig(k_bounds[1], seq_bounds[1], 4096)
    for i, demand in enumerate(demands):
        plant = Plant(demand=demand, per_pos=tuple(acceptance ** (j + 1) for j in range(8)))
        obs = (
            Observation(time=i * INTERVAL, config=config, error="down")
            if missing[i]
            else plant.observe(i * INTERVAL, config)
        )
        decision = policy.decide(obs)
        assert decision.reason
        if decision.config is not None:
            assert bounds.contains(decision.config), (decision.config, bounds)
            config = decision.config


def test_while_the_replica_knob_has_room_tpot_over_target_adds_replicas_instead_of_cutting_the_batch() -> (
    None
):
    """The joint loop: the same overload as above (at 32 sequences), with the replica knob beside the policy
    (maxReplicas 2, a new replica serving two intervals after it is asked for). The config does not cut
    max_num_seqs below the requests per engine while a replica can still be added or is starting (that
    would only queue them); once both replicas serve, the batch limit is the config's to try again."""
    from specfleet.tuner.policy.replicas import ReplicaParams, ReplicaPolicy

    plant = Plant(demand=64)
    policy = Policy(PARAMS)
    replicas = ReplicaPolicy(ReplicaParams(min_replicas=1, max_replicas=2, cooldown_s=0.0), 1)
    config, started = TunedConfig(0, 32, 2048), None
    seqs: dict[bool, list[int]] = {True: [], False: []}  # max_num_seqs decided with and without room
    for i in range(16):
        t = i * INTERVAL
        if started is not None and t - started >= 2 * INTERVAL:
            plant.pods = replicas.replicas  # the new replica is ready and routed to
        policy.replica_room = replicas.room
        obs = plant.observe(t, config)
        decision = policy.decide(obs)
        if decision.config is not None:
            config = decision.config
        seqs[policy.replica_room].append(config.max_num_seqs)
        scaled = replicas.decide(t, obs, policy.model(obs), policy.current, SLO_CPU)
        if scaled.changed:
            started = t
    assert replicas.replicas == 2 and plant.pods == 2
    assert seqs[True] and min(seqs[True]) == 32  # held while a replica could be added or was starting
    assert min(seqs[False]) < 32  # both serving, TPOT still over: the config tried a cut (judged as any)


def test_a_hold_for_the_replica_knob_says_so() -> None:
    plant = Plant(demand=64)
    policy = Policy(PARAMS)
    policy.replica_room = True
    config = TunedConfig(0, 64, 2048)
    reasons = [policy.decide(plant.observe(i * INTERVAL, config)).reason for i in range(4)]
    assert policy.current == config
    assert any("capacity is the replica knob's" in r and "64 requests per engine" in r for r in reasons), (
        reasons
    )
