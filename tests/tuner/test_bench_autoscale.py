"""`bench autoscale`'s arithmetic: goodput per replica-second, SLO attainment weighted by requests, the
replica-seconds meter (a replica costs while its process runs, starting and draining included) and the
cold starts its JSON reports."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest
from specfleet.bench.autoscale import (
    ReplicaMeter,
    _isvc,
    build_parser,
    cold_starts,
    phases,
    summarize,
    summarize_run,
    tpot_target,
)
from specfleet.fleet.engines import Startup


def test_goodput_per_replica_second_counts_good_tokens_over_the_replicas_paid_for() -> None:
    figures = {
        "low": {"goodput": 10.0, "seconds": 30.0, "requests": 10, "slo_attainment": 1.0},
        "high": {"goodput": 50.0, "seconds": 30.0, "requests": 30, "slo_attainment": 0.8},
    }
    one = summarize_run(figures, replica_seconds=60.0)
    two = summarize_run(figures, replica_seconds=120.0)
    assert one["good_tokens"] == pytest.approx(1800.0)
    assert one["goodput_per_replica_s"] == pytest.approx(30.0) and two[
        "goodput_per_replica_s"
    ] == pytest.approx(15.0)
    assert one["slo_attainment"] == pytest.approx((10 * 1.0 + 30 * 0.8) / 40)


@dataclass
class _Engine:
    running: bool = True


@dataclass
class _Fleet:
    engines: list[_Engine] = field(default_factory=list)


def test_the_meter_integrates_running_engines() -> None:
    fleet = _Fleet([_Engine(), _Engine(running=False)])

    async def scenario() -> float:
        with ReplicaMeter(fleet, period_s=0.02) as meter:
            await asyncio.sleep(0.2)
            fleet.engines[1].running = True  # a scale-up: the new engine costs from its start
            await asyncio.sleep(0.2)
        return meter.seconds

    assert 0.45 < asyncio.run(scenario()) < 0.75  # 0.2 s x 1 + 0.2 s x 2, give or take a period


def test_the_load_rises_and_falls() -> None:
    names = [(p.name, p.concurrency) for p in phases(build_parser().parse_args([]))]
    assert [c for _, c in names] == [2, 24, 2] and len({n for n, _ in names}) == 3


def test_the_tpot_target_lies_between_one_replica_and_two() -> None:
    """Calibrated (the default): the geometric mean of the TPOT p95 the fewest and the most replicas
    reached at the high phase, so the high phase needs the second replica; the figures go in the JSON."""
    assert build_parser().parse_args([]).tpot_ms is None
    assert build_parser().parse_args(["--tpot-ms", "230"]).tpot_ms == 230
    out = tpot_target({1: 289.0, 2: 187.0})
    assert out == {"tpot_target_ms": 232, "tpot_p95_ms_by_replicas": {"1": 289.0, "2": 187.0}}
    assert 187.0 < out["tpot_target_ms"] < 289.0
    assert tpot_target({2: 100.0, 1: 100.0})["tpot_target_ms"] == 100  # no gain from more: said, not hidden


def test_the_fleets_spec_carries_the_slo_once_it_is_known() -> None:
    """The static grid's fleet starts before the calibration and runs no tuner: no SLO in its spec; the
    joint fleet's tuner gets the calibrated target."""
    args = build_parser().parse_args([])
    static = _isvc(args, autoscaling=False, replicas=2)
    args.tpot_ms = 233
    joint = _isvc(args, autoscaling=True, replicas=1)
    assert static.spec.slo.tpot_p95_ms != 233 and joint.spec.slo.tpot_p95_ms == 233


def test_cold_starts_are_the_engines_started_during_the_run_and_reach_the_summary() -> None:
    """The supervisor's startups (process start to first ready probe): the fleet's own engine at start is
    not a cold start of the run; a scale-up is, and a restart is listed apart. The router's scale-from-zero
    wait (None here: minReplicas 1 never reaches zero) is carried as measured."""
    startups = [
        Startup(0, "start", ready_at=95.0, seconds=4.0),
        Startup(1, "scale-up", ready_at=130.0, seconds=6.25),
        Startup(1, "restart", ready_at=160.0, seconds=3.0),
        Startup(2, "scale-up", ready_at=190.0, seconds=5.5),
    ]
    colds = cold_starts(startups, t0=100.0, from_zero_s=None)
    assert colds["cold_starts"] == [
        {"engine": 1, "cause": "scale-up", "t": 30.0, "seconds": 6.25},
        {"engine": 1, "cause": "restart", "t": 60.0, "seconds": 3.0},
        {"engine": 2, "cause": "scale-up", "t": 90.0, "seconds": 5.5},
    ]
    assert colds["cold_start_s_max"] == 6.25 and colds["scale_from_zero_cold_start_s"] is None
    assert cold_starts(startups[:1], 100.0, 2.345) == {
        "cold_starts": [],
        "cold_start_s_max": None,
        "scale_from_zero_cold_start_s": 2.35,
    }
    figures = {"p": {"goodput": 1.0, "seconds": 10.0, "requests": 1, "slo_attainment": 1.0}}
    run = {**summarize_run(figures, 10.0), "replica_changes": {}, "config_changes": {}, **colds}
    out = summarize(
        build_parser().parse_args([]), {"replicas=1,k=0,seqs=32": summarize_run(figures, 10.0)}, run
    )
    assert (out["cold_start_s"], out["cold_start_s_max"], out["scale_from_zero_cold_start_s"]) == (
        [6.25, 5.5],
        6.25,
        None,
    )
    assert json.loads(json.dumps(out)) == out  # the JSON the bench writes
