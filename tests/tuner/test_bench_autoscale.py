"""`bench autoscale`'s arithmetic: goodput per replica-second, SLO attainment weighted by requests, and the
replica-seconds meter (a replica costs while its process runs, starting and draining included)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from specfleet.bench.autoscale import ReplicaMeter, build_parser, phases, summarize_run


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
