"""The serving path as a two-stage pipeline (`Profile.period_s`): the engine core's step beside the API
server's work on the previous step's output, a step lasting the longer of the two, and a step's tokens
reaching their clients when the server has sent them. Hand-computed against the test profile: a 20 ms
decode step up to 8 tokens (3 ms a token past 8), 2 ms a prompt token, so a 10-token prefill is 40 ms."""

from __future__ import annotations

import pytest
from specfleet.bench.sim import server_work
from specfleet.sim.fleet import SimFleet
from specfleet.sim.report import summarize
from specfleet.sim.workload import SimRequest

from .test_sim_fleet import PROFILE, isvc, mixed_requests


def step_histogram(fleet: SimFleet) -> tuple[float, int]:
    h = fleet.engines[0].metrics.histograms["step_duration_seconds"]
    return h.sum, h.count


def test_a_step_lasts_the_longer_of_the_core_and_the_server():
    p = PROFILE.with_(step_overhead_s=0.004, stream_overhead_s=0.004)
    assert p.core_s(16) == pytest.approx(0.044)
    assert p.server_s(16) == pytest.approx(0.004 + 16 * 0.004)
    assert p.step_s(4, streams=4) == pytest.approx(0.020)  # the server's 20 ms beside a 20 ms core step
    assert p.step_s(2, streams=2) == pytest.approx(0.020)  # hidden: 12 ms
    assert p.step_s(16, streams=16) == pytest.approx(0.068)  # the server's 68 ms against the core's 44
    assert p.step_s(16, 0, 0, 0, streams=0) == pytest.approx(0.044)
    assert p.period_s(0.020, -1.0) == 0.020  # the server idle since before the step
    # zero serving overheads: the core's step, the same float as the sum of its terms
    q = PROFILE.with_(context_s_per_token=1e-5, draft_s_per_token=1e-3)
    assert q.step_s(5, 30, 100, 2, streams=5) == q.decode_s(5) + 0.002 * 30 + 1e-5 * 100 + 1e-3 * 2


def test_server_work_hides_under_a_longer_core_step():
    p = PROFILE.with_(step_overhead_s=0.003, stream_overhead_s=0.005)  # 8 ms for one stream
    for fast in (False, True):
        fleet = SimFleet(isvc(), p, fast=fast)
        (r,) = fleet.run([SimRequest(1.0, 10, 11)]).records
        # the first token: the prefill, then the server's work on it
        assert r.first_token_s - r.arrival_s == pytest.approx(0.040 + 0.008)
        # the server's 8 ms on each token runs beside the core's next 20 ms step
        assert r.finish_s - r.first_token_s == pytest.approx(10 * 0.020)
        # the engine's step histogram holds the core's seconds, as the real engine's own does
        assert step_histogram(fleet) == (pytest.approx(0.040 + 10 * 0.020), 11)


def test_server_work_sets_the_pace_when_it_is_longer_than_the_core_step():
    p = PROFILE.with_(step_overhead_s=0.030)  # the server's 30 ms per step against the core's 20
    for fast in (False, True):
        fleet = SimFleet(isvc(), p, fast=fast)
        (r,) = fleet.run([SimRequest(0.0, 10, 11)]).records
        assert r.first_token_s == pytest.approx(0.040 + 0.030)
        # every decode step waits for the server to finish the previous step's output: 30 ms apart
        assert r.finish_s - r.first_token_s == pytest.approx(10 * 0.030)
        assert step_histogram(fleet) == (pytest.approx(0.040 + 10 * 0.020), 11)  # the core's, not 30 ms
    # eight streams: the server's 8 * 5 = 40 ms against the core's 20 ms step
    many = PROFILE.with_(stream_overhead_s=0.005)
    for fast in (False, True):
        records = SimFleet(isvc(), many, fast=fast).run([SimRequest(0.0, 10, 11) for _ in range(8)]).records
        # the first alone (40 ms prefill, 5 ms for its token); the other seven join it in one step
        # (20 + 70 * 2 = 160 ms, eight streams); then the server's 40 ms on eight streams paces every step
        first, *rest = sorted(records, key=lambda r: r.index)
        assert first.first_token_s == pytest.approx(0.045)
        assert first.finish_s == pytest.approx(0.040 + 0.160 + 9 * 0.040 + 0.040)
        for r in rest:
            assert r.first_token_s == pytest.approx(0.040 + 0.160 + 0.040)
            assert r.finish_s == pytest.approx(0.040 + 0.160 + 10 * 0.040 + 7 * 0.005)


def test_after_an_idle_gap_the_core_waits_for_what_is_left_of_the_server_work():
    p = PROFILE.with_(step_overhead_s=0.050)
    a, b, c = (SimRequest(t, 10, 1) for t in (0.0, 0.045, 1.0))
    for fast in (False, True):
        ra, rb, rc = sorted(SimFleet(isvc(), p, fast=fast).run([a, b, c]).records, key=lambda r: r.index)
        assert ra.first_token_s == ra.finish_s == pytest.approx(0.040 + 0.050)
        # b's 40 ms prefill ends at 85 ms, but the server holds a's output until 90 ms: b's step ends then
        assert rb.first_token_s == pytest.approx(0.090 + 0.050)
        assert rc.first_token_s - rc.arrival_s == pytest.approx(0.040 + 0.050)  # the server idle again


def test_zero_serving_overheads_give_the_core_steps():
    assert PROFILE.step_overhead_s == PROFILE.stream_overhead_s == 0.0
    four = [SimRequest(0.0, 10, 11) for _ in range(4)]
    for fast in (False, True):
        fleet = SimFleet(isvc(), PROFILE, fast=fast)
        first, *rest = sorted(fleet.run(four).records, key=lambda r: r.index)
        assert first.first_token_s == pytest.approx(0.040, abs=1e-12)
        assert first.finish_s == pytest.approx(0.040 + 0.080 + 9 * 0.020, abs=1e-12)
        for r in rest:
            assert r.first_token_s == pytest.approx(0.120, abs=1e-12)
            assert r.finish_s == pytest.approx(0.120 + 10 * 0.020, abs=1e-12)
        assert step_histogram(fleet) == (pytest.approx(0.040 + 0.080 + 10 * 0.020, abs=1e-12), 12)


def test_fast_mode_equals_exact_mode_with_serving_overheads():
    reqs = mixed_requests()
    # the server's 2 + 3 ms a stream: hidden below 6 streams, the pace from 7 (and at 16 against 44 ms)
    p = PROFILE.with_(num_kv_blocks=64, step_overhead_s=0.002, stream_overhead_s=0.003)
    exact_fleet = SimFleet(isvc(replicas=2), p)
    exact = exact_fleet.run(reqs)
    fleet = SimFleet(isvc(replicas=2), p, fast=True)
    fast = fleet.run(reqs)
    assert sum(e.fast_runs for e in fleet.engines) > 20
    assert sum(r.preemptions for r in exact.records) > 0
    assert fast.steps == exact.steps
    key = lambda r: r.index  # noqa: E731
    for a, b in zip(sorted(exact.records, key=key), sorted(fast.records, key=key), strict=True):
        assert (a.engine, a.output_tokens, a.preemptions) == (b.engine, b.output_tokens, b.preemptions)
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-9)
        assert a.itl_sum == pytest.approx(b.itl_sum, abs=1e-9)
    for e, f in zip(exact_fleet.engines, fleet.engines, strict=True):  # the core's seconds, in both modes
        h, g = e.metrics.histograms["step_duration_seconds"], f.metrics.histograms["step_duration_seconds"]
        assert (h.count, h.sum) == (g.count, pytest.approx(g.sum, rel=1e-9))
    # the overheads showed: slower tokens than the same fleet without them
    without = summarize(
        SimFleet(isvc(replicas=2), p.with_(step_overhead_s=0.0, stream_overhead_s=0.0)).run(reqs), p, {}
    )
    assert summarize(exact, p, {})["p50_tpot_ms"] > without["p50_tpot_ms"]


def test_bench_sim_reads_the_server_work_only_where_it_set_the_pace():
    # (client TPOT, the core's mean step, mean batch) of the lone phase and of the burst
    assert server_work((0.030, 0.020, 1.0), (0.100, 0.040, 8.0)) == pytest.approx((0.020, 0.010))
    assert server_work((0.021, 0.020, 1.0), (0.080, 0.040, 8.0)) == pytest.approx((0.0, 0.010))
    assert server_work((0.030, 0.020, 1.0), (0.041, 0.040, 8.0)) == pytest.approx((0.030, 0.0))
    assert server_work((0.020, 0.020, 1.0), (0.040, 0.040, 8.0)) == (0.0, 0.0)
