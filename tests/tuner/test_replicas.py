"""The tuner's replica decisions on synthetic observations: capacity from the goodput model, the HPA's
stabilization windows and a cooldown, one replica per change, bounds, scale to and from zero."""

from __future__ import annotations

from dataclasses import replace

import pytest
from specfleet.tuner.policy.model import LoadModel, StepCost
from specfleet.tuner.policy.replicas import ReplicaParams, ReplicaPolicy, capacity_per_replica
from specfleet.tuner.types import SLO, Observation, TunedConfig

CONFIG = TunedConfig(0, 16, 512)
SLO_ = SLO(2.0, 0.05)
# 18 ms floor, 3 ms per token (the bundled model on 2 cores, tuner/policy/model.py): at k=0 the mean TPOT
# stays under 0.8 x 50 ms up to 11 sequences per engine.
MODEL = LoadModel(
    demand=1.0, per_pos=(), proposal_share=0.0, prefill_per_output=0.0, cost=StepCost(0.018, 0.003)
)


def obs(t: float, demand: float, waiting: float = 0.0, rate: float = 1.0) -> Observation:
    return Observation(
        time=t,
        config=CONFIG,
        pods=1,
        running=demand - waiting,
        waiting=waiting,
        request_rate=rate,
        generation_rate=10.0,
    )


def policy(replicas: int = 1, **params: float) -> ReplicaPolicy:
    defaults = {"min_replicas": 1, "max_replicas": 3, "scale_down_window_s": 60.0, "cooldown_s": 30.0}
    return ReplicaPolicy(ReplicaParams(**{**defaults, **params}), replicas)


def test_capacity_per_replica_from_the_model():
    assert capacity_per_replica(MODEL, CONFIG, SLO_, 0.8) == 11
    assert capacity_per_replica(MODEL, TunedConfig(0, 4, 512), SLO_, 0.8) == 4  # never past max_num_seqs
    assert capacity_per_replica(MODEL, CONFIG, SLO(2.0, 0.001), 0.8) == 1  # nothing meets it: one each


def test_scale_up_at_once_then_cooldown_then_one_step_at_a_time():
    p = policy()
    d = p.decide(0.0, obs(0.0, 30), MODEL, CONFIG, SLO_)
    assert (d.kind, d.previous, d.replicas) == ("scale-up", 1, 2)  # 30 needs 3: one replica per change
    assert "30.0 requests in the system at 11 per replica" in d.reason and "need 3 replicas" in d.reason
    d = p.decide(10.0, obs(10.0, 30), MODEL, CONFIG, SLO_)
    assert (d.kind, d.replicas) == ("cooldown", 2)
    d = p.decide(31.0, obs(31.0, 30), MODEL, CONFIG, SLO_)
    assert (d.kind, d.replicas) == ("scale-up", 3)
    d = p.decide(70.0, obs(70.0, 60), MODEL, CONFIG, SLO_)
    assert (d.kind, d.replicas) == ("hold", 3)  # maxReplicas


def test_scale_down_waits_for_the_window_and_keeps_headroom():
    p = policy(replicas=2)
    assert p.decide(0.0, obs(0.0, 9.5), MODEL, CONFIG, SLO_).kind == "hold"  # 9.5 > 0.8 x 11: keep two
    d = p.decide(10.0, obs(10.0, 4), MODEL, CONFIG, SLO_)
    assert d.kind == "stabilizing" and "60s window" in d.reason
    d = p.decide(50.0, obs(50.0, 4), MODEL, CONFIG, SLO_)
    assert d.kind == "stabilizing"
    d = p.decide(65.0, obs(65.0, 4), MODEL, CONFIG, SLO_)
    assert (d.kind, d.replicas) == ("scale-down", 1) and "fit in 1 with 20% headroom" in d.reason
    assert p.decide(200.0, obs(200.0, 0, rate=0.0), MODEL, CONFIG, SLO_).replicas == 1  # minReplicas


def test_a_brief_rise_inside_the_window_blocks_a_scale_down():
    p = policy(replicas=2)
    for t, demand in ((0, 4), (20, 4), (40, 15), (61, 4), (90, 4)):
        d = p.decide(float(t), obs(float(t), demand), MODEL, CONFIG, SLO_)
        assert d.replicas == 2, (t, d)  # the highest recommendation of the last 60 s was 2
    assert p.decide(101.0, obs(101.0, 4), MODEL, CONFIG, SLO_).replicas == 1


def test_slo_missed_with_requests_waiting_adds_a_replica():
    p = policy()
    miss = Observation(
        time=0.0,
        config=CONFIG,
        pods=1,
        running=6,
        waiting=2,
        request_rate=1.0,
        generation_rate=10.0,
        tpot_cdf=[(0.05, 0.5), (0.2, 1.0)],
    )
    d = p.decide(0.0, miss, MODEL, CONFIG, SLO_)
    assert (d.kind, d.replicas) == ("scale-up", 2) and "SLO attainment is 0.50" in d.reason


def test_scale_to_zero_and_back():
    p = policy(min_replicas=0)
    assert p.decide(0.0, obs(0.0, 0, rate=0.0), MODEL, CONFIG, SLO_).kind == "stabilizing"
    d = p.decide(61.0, obs(61.0, 0, rate=0.0), MODEL, CONFIG, SLO_)
    assert (d.kind, d.replicas) == ("scale-down", 0)
    assert p.decide(70.0, None, None, CONFIG, SLO_).kind == "hold"
    d = p.decide(80.0, None, None, CONFIG, SLO_, queued=3)
    assert (d.kind, d.replicas) == ("scale-up", 1) and "scale from zero" in d.reason


def test_at_most_two_changes_per_load_transition():
    """A load that steps 4 -> 25 -> 4, decided every 5 s: each level brings at most two changes, and the
    count ends where the level needs it."""
    p = policy()
    changes: dict[int, int] = {}
    for t in range(0, 600, 5):
        level = 0 if t < 200 else 1 if t < 400 else 2
        d = p.decide(float(t), obs(float(t), (4, 25, 4)[level]), MODEL, CONFIG, SLO_)
        changes[level] = changes.get(level, 0) + d.changed
    assert p.replicas == 1 and max(changes.values()) <= 2 and changes[1] == 2


def test_bad_bounds_are_refused_with_the_fields():
    with pytest.raises(ValueError, match="minReplicas=3 must be >= 0 and <= maxReplicas=2"):
        ReplicaParams(min_replicas=3, max_replicas=2)


def test_status_and_event_of_a_decision():
    from specfleet.tuner.report import autoscaling_status, scale_event

    p = policy()
    up = p.decide(0.0, obs(0.0, 30), MODEL, CONFIG, SLO_)
    status = autoscaling_status(up, None, "2026-01-01T00:00:00Z")
    assert status["replicas"] == 2 and status["lastScaleTime"] == "2026-01-01T00:00:00Z"
    assert status["reason"].startswith("scale-up 1 -> 2:")
    assert scale_event(up) == ("Normal", "Scaled", up.reason)
    hold = p.decide(5.0, obs(5.0, 30), MODEL, CONFIG, SLO_)
    assert autoscaling_status(hold, status, "2026-01-01T00:00:05Z")["lastScaleTime"] == "2026-01-01T00:00:00Z"
    assert scale_event(hold) is None


def test_room_while_below_the_maximum_or_a_new_replica_is_not_serving_yet():
    p = policy(1, max_replicas=2, cooldown_s=0.0)
    assert p.room  # 1 of 2
    p.decide(0.0, obs(0.0, demand=30, waiting=10), MODEL, CONFIG, SLO_)
    assert p.replicas == 2 and p.room  # asked for, and the observation still shows one pod serving
    p.decide(10.0, replace(obs(10.0, demand=30, waiting=10), pods=2), MODEL, CONFIG, SLO_)
    assert p.serving == 2 and not p.room  # both serve: nothing left to add


def test_a_rise_scales_up_at_the_first_interval_from_the_count_now():
    p = policy(1, max_replicas=3, cooldown_s=0.0)
    # the window's mean still mostly the old load (2.5); the gauges already show 30 in the system
    rising = replace(obs(0.0, demand=2.5), in_system_now=30.0)
    decision = p.decide(0.0, rising, MODEL, CONFIG, SLO_)
    assert decision.kind == "scale-up" and decision.replicas == 2
    assert "30.0 requests in the system" in decision.reason


def test_a_fall_seen_only_now_does_not_scale_down_before_the_window():
    p = policy(2, scale_down_window_s=60.0)
    falling = replace(obs(0.0, demand=20.0), in_system_now=1.0)  # the mean still counts the old load
    assert p.decide(0.0, falling, MODEL, CONFIG, SLO_).replicas == 2


def test_the_decisions_kept_are_changes_and_held_back_changes_not_plain_holds():
    p = policy(replicas=2)
    decisions = [
        p.decide(t, obs(t, demand), MODEL, CONFIG, SLO_)
        for t, demand in ((0.0, 9.5), (10.0, 4), (65.0, 4), (70.0, 30), (100.0, 30))
    ]
    assert [(d.kind, d.notable) for d in decisions] == [
        ("hold", False),  # 9.5 requests keep two replicas: nothing to report
        ("stabilizing", True),  # a scale-down held back by its window
        ("scale-down", True),
        ("cooldown", True),  # a scale-up held back by the cooldown
        ("scale-up", True),
    ]
