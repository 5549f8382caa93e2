"""bench sim's reading of the proposer from the real engines' /metrics, and what the simulated engines then
report to the simulated tuner: the verified positions continued past their k by the shadow drafts' ratios,
and the shadow drafts found at the engines' own per-lookup rate (issue 41: the two tuners decided k = 2
and k = 4 on one workload when the simulator extrapolated the positions and diluted the shadow share)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web
from helpers import cpu_like_profile
from specfleet.bench.sim import Acceptance, continued, scrape_acceptance
from specfleet.operator import load_inference_service
from specfleet.sim.fleet import SimFleet
from specfleet.sim.workload import Lengths, Synthetic


def test_verified_positions_go_on_at_the_shadow_drafts_ratios():
    shadow = (0.9, 0.8, 0.08, 0.04)
    out = continued((0.8, 0.775), shadow)
    assert out[:2] == (0.8, 0.775)
    # P(3 | 2) and P(4 | 3) of the shadow drafts: 0.1 and 0.5 (not the last verified ratio, 0.97)
    assert out[2] == pytest.approx(0.0775) and out[3] == pytest.approx(0.03875)
    assert continued((0.8, 0.775), ()) == (0.8, 0.775)  # no shadow drafts: nothing to continue with
    assert continued((), shadow) == shadow  # none verified: the shadow drafts' own
    assert continued((0.8,), (0.5, 0.0, 0.0)) == (0.8, 0.0, 0.0)  # a position never reached stays at 0
    # shadow drafts that never got as far as the verified ones (bench sim's copy-1e-spec, 2026-12-06: eight
    # positions of 0 at k = 4) give no ratio to continue with: the verified positions alone
    assert continued((0.66, 0.52, 0.45, 0.39), (0.0,) * 8) == (0.66, 0.52, 0.45, 0.39)


def metrics_text(verified: list[float], drafts: float, shadow: list[float], shadow_drafts: float) -> str:
    """An engine's /metrics as the engine's exposition names them (engine/server/metrics.py)."""
    m = 'model_name="m"'
    lines = [
        f"specfleet_spec_decode_drafts_total{{{m}}} {drafts}",
        f"specfleet_spec_decode_draft_tokens_total{{{m}}} {drafts * 1.9}",
        f"specfleet_spec_decode_shadow_drafts_total{{{m}}} {shadow_drafts}",
        f"specfleet_spec_decode_shadow_lookups_total{{{m}}} {shadow_drafts * 4}",
        "specfleet_batch_size_bucket{" + m + ',le="+Inf"} 100',
        f"specfleet_batch_size_sum{{{m}}} 1000",
        f"specfleet_batch_size_count{{{m}}} 100",
    ]
    lines += [
        f'specfleet_spec_decode_accepted_tokens_per_pos_total{{{m},position="{i}"}} {v}'
        for i, v in enumerate(verified)
    ]
    lines += [
        f'specfleet_spec_decode_shadow_accepted_tokens_per_pos_total{{{m},position="{i}"}} {v}'
        for i, v in enumerate(shadow)
    ]
    return "\n".join(lines) + "\n"


async def _scrape(texts: list[str]) -> Acceptance:
    runners, urls = [], []
    for text in texts:
        app = web.Application()

        async def handle(_: web.Request, body: str = text) -> web.Response:
            return web.Response(text=body, content_type="text/plain")

        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        return await scrape_acceptance(urls)
    finally:
        for runner in runners:
            await runner.cleanup()


def test_scrape_continues_verified_positions_with_the_shadow_and_keeps_the_per_lookup_share():
    # two engines over real sockets, summed: 100 drafts verified at k = 2, 50 shadow drafts of 4 positions
    # found by 200 lookups (while k was 0)
    a = metrics_text([40, 38], 50, [22, 20, 2, 1], 25)
    b = metrics_text([40, 39.5], 50, [23, 20, 3, 1], 25)
    acc = asyncio.run(_scrape([a, b]))
    assert acc.source == "verified+shadow" and acc.verified_k == 2
    assert acc.per_pos[:2] == pytest.approx((0.8, 0.775))
    assert acc.per_pos[2] == pytest.approx(0.775 * 5 / 40) and acc.per_pos[3] == pytest.approx(0.775 * 2 / 40)
    assert acc.shadow_per_pos == pytest.approx((0.9, 0.8, 0.1, 0.04))
    assert acc.shadow_share == pytest.approx(0.25)  # per lookup, as the engines count them
    assert acc.share == pytest.approx(100 / 2000)  # verified drafts per sequence-step
    assert acc.length == pytest.approx(1.9)
    # none verified (k stayed 0): the shadow drafts' own figures
    only = asyncio.run(_scrape([metrics_text([], 0, [22, 20, 2, 1], 25)]))
    assert only.source == "shadow" and only.verified_k == 0
    assert only.per_pos == pytest.approx((0.88, 0.8, 0.08, 0.04)) and only.share == pytest.approx(0.25)


def _ngram_k0_service() -> dict[str, Any]:
    """An n-gram service at k = 0 (its engines make shadow lookups) on a CPU-like profile."""
    return {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 2048},
            "batching": {"maxNumSeqs": 32, "maxNumBatchedTokens": 512},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 0},
            "resources": {"gpus": 0},
            "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 200},
        },
    }


def _chat_trace(seed: int) -> list[Any]:
    """30 s of 3 requests a second, 16-96 prompt tokens and 32-96 output tokens."""
    workload = Synthetic(
        rates=((0.0, 3.0),),
        duration_s=30,
        prompt=Lengths("uniform", 16, 96),
        output=Lengths("uniform", 32, 96),
        seed=seed,
    )
    return list(workload.requests())


def test_simulated_shadow_drafts_report_the_engines_per_lookup_share_and_positions():
    """With k = 0 the simulated engines' shadow counters, which the simulated tuner reads, hold the share and
    positions bench sim measured on the real engines, not the verified drafts' per-step share."""
    doc = _ngram_k0_service()
    reqs = _chat_trace(seed=3)
    per_pos = continued((0.8, 0.775), (0.9, 0.8, 0.08, 0.04))
    profile = cpu_like_profile(num_kv_blocks=256).with_(proposal_share=0.03, shadow_share=0.4)
    fleet = SimFleet(load_inference_service(doc), profile, accepted_per_pos=per_pos)
    fleet.run(reqs)
    snap = fleet.engines[0].snapshot(fleet.now)
    lookups, found = snap.counters["spec_decode_shadow_lookups"], snap.counters["spec_decode_shadow_drafts"]
    assert lookups > 500
    assert found / lookups == pytest.approx(0.4, abs=0.05)  # not the per-step 0.03
    shadow = [snap.per_pos["spec_decode_shadow_accepted_tokens_per_pos"][i] / found for i in range(4)]
    # the positions past the verified k follow the shadow drafts' fall, not the last verified ratio (0.97)
    assert shadow[0] == pytest.approx(0.8, abs=0.06) and shadow[1] == pytest.approx(0.775, abs=0.06)
    assert shadow[2] < 0.15 and shadow[3] < 0.1
    # without a shadow share of its own, the profile's proposal share, as before
    fallback = SimFleet(
        load_inference_service(doc), profile.with_(shadow_share=None), accepted_per_pos=per_pos
    )
    fallback.run(reqs)
    snap = fallback.engines[0].snapshot(fallback.now)
    share = snap.counters["spec_decode_shadow_drafts"] / snap.counters["spec_decode_shadow_lookups"]
    assert share == pytest.approx(0.03, abs=0.02)


def test_simulated_shadow_drafts_follow_the_engines_shadow_positions_over_a_few_verified_drafts():
    """bench sim, 2026-12-06: the real tuner's k = 1 verified a handful of drafts, all accepted (1.0), where
    hundreds of shadow lookups read 0.82 / 0.79 / 0.60 / 0.45; the simulated shadow drafts, drawn from the
    verified figure, reported 1.0 at the first position and the simulated tuner chose k = 4 where the real
    one chose k = 1. Given the engines' shadow positions, the simulated shadow drafts report those."""
    doc = _ngram_k0_service()
    reqs = _chat_trace(seed=4)
    shadow = (0.82, 0.79, 0.6, 0.45)
    profile = cpu_like_profile(num_kv_blocks=256).with_(shadow_share=0.6, shadow_accepted_per_pos=shadow)
    fleet = SimFleet(load_inference_service(doc), profile, accepted_per_pos=(1.0, 0.96, 0.7, 0.55))
    fleet.run(reqs)
    snap = fleet.engines[0].snapshot(fleet.now)
    found = snap.counters["spec_decode_shadow_drafts"]
    assert found > 300
    seen = [snap.per_pos["spec_decode_shadow_accepted_tokens_per_pos"][i] / found for i in range(4)]
    assert seen == pytest.approx(list(shadow), abs=0.06)


def test_a_shadow_share_outside_0_1_is_refused_by_name():
    with pytest.raises(ValueError, match="shadow_share"):
        cpu_like_profile(num_kv_blocks=256).with_(shadow_share=1.5)
    with pytest.raises(ValueError, match="shadow_accepted_per_pos"):
        cpu_like_profile(num_kv_blocks=256).with_(shadow_accepted_per_pos=(0.5, 1.2))


def test_ttft_parts_split_the_clients_ttft_into_the_engines_and_the_path():
    """bench sim's `ttft_parts`: the engines' own mean TTFT (their histograms) against the clients'; in the
    simulation the difference is the profile's request overhead, which the engines never see."""
    from specfleet.bench.sim import _mean_ms, sim_mix

    doc = {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 2048},
            "batching": {"maxNumSeqs": 8, "maxNumBatchedTokens": 512},
            "resources": {"gpus": 0},
            "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 200},
        },
    }
    reqs = list(
        Synthetic(
            rates=((0.0, 4.0),),
            duration_s=10,
            prompt=Lengths("uniform", 16, 96),
            output=Lengths("uniform", 16, 64),
            seed=2,
        ).requests()
    )
    fleet = SimFleet(
        load_inference_service(doc), cpu_like_profile(num_kv_blocks=256).with_(request_overhead_s=0.04)
    )
    run = fleet.run(reqs)
    parts = sim_mix(fleet).ttft_ms()
    client = _mean_ms(r.first_token_s - r.arrival_s for r in run.records if r.first_token_s is not None)
    assert parts["engine_queue_ms_mean"] > 0  # 8 sequences at most: some wait
    assert parts["engine_ttft_ms_mean"] > parts["engine_queue_ms_mean"]
    assert client - parts["engine_ttft_ms_mean"] == pytest.approx(40.0, abs=0.3)


def test_bench_sim_records_the_host_it_ran_on():
    from specfleet.bench.sim import build_parser, host_record

    args = build_parser().parse_args(["--quick", "--cpus-per-engine", "1"])
    host = host_record(args, (1.0, 2.0, 3.0))
    assert host["cores"] >= 1 and host["cpus_per_engine"] == 1 and host["threads_per_engine"] == 1
    assert host["load_average_start"] == [1.0, 2.0, 3.0] and len(host["load_average_end"]) == 3


def test_the_real_tuner_ticks_with_the_trace_on_a_fixed_schedule():
    """bench sim's real tuner: a tick at the trace's start and every interval after it, however long a tick
    takes (no drift), until the first tick after the trace ended: the simulated tuner's schedule. The fleet
    stands in for `LocalFleet`, of which only `tick` is called.

    A loaded host wakes a sleeper late, never early: each tick may start late by less than a tick's cost
    (half the interval), which a schedule that drifts exceeds from its second tick on (it adds a tick's
    cost every interval). Where the trace's end falls among the ticks is read from the loop's own order,
    not the clock: the loop looks at `done` right after each tick, in the same step as the tick's end."""
    from specfleet.bench.sim import tick_with_the_trace

    interval_s, tick_s, trace_s = 0.2, 0.1, 0.75  # the trace ends between the ticks due at 0.6 and 0.8

    class Fleet:
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []

        async def tick(self) -> None:
            self.starts.append(time.perf_counter())
            await asyncio.sleep(tick_s)  # a scrape of loaded engines takes a while
            self.ends.append(time.perf_counter())

    async def run() -> tuple[Fleet, float, float]:
        fleet, done = Fleet(), asyncio.Event()
        start = time.perf_counter()
        task = asyncio.create_task(tick_with_the_trace(fleet, interval_s, done))
        await asyncio.sleep(trace_s)  # the trace
        done.set()
        end = time.perf_counter()
        await task
        return fleet, start, end

    fleet, start, end = asyncio.run(run())
    times = [t - start for t in fleet.starts]
    for i, t in enumerate(times):
        # due at i intervals: not before (1 ms for the clock read between `start` and the loop's own), and
        # later by less than a tick's cost: the time a tick takes does not add up
        assert interval_s * i - 0.001 <= t < interval_s * i + tick_s, (i, times)
    # every tick but the last ended before the trace did, the last after it: the first tick after the end
    assert all(e < end for e in fleet.ends[:-1]) and fleet.ends[-1] > end, (fleet.ends, end)


def test_host_cpu_counts_the_bench_and_its_children_apart_from_other_processes():
    """`HostCpu`: a child of the bench (as the engines are) burning CPU counts as the bench's; the
    difference from the host's busy time is the other processes'."""
    import subprocess

    from specfleet.bench.sim import HostCpu
    from specfleet.engine.python_child import python_command

    before = HostCpu.read()
    if before is None:
        pytest.skip("no /proc on this host")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\nprint('burnt', flush=True)\ntime.sleep(30)"
    child = subprocess.Popen(python_command("-c", burn), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        after = HostCpu.read()  # while the child lives: its CPU time is read from its /proc entry
    finally:
        child.kill()
        child.wait()
    assert after is not None
    assert after.ours - before.ours >= 0.5  # the child's CPU seconds, and the interpreter's start
    assert after.busy - before.busy >= after.ours - before.ours - 0.05  # the host saw them too
    seen = after.since(before)
    assert seen["others_cores"] == pytest.approx(
        max(0.0, seen["busy_cores"] - seen["bench_cores"]), abs=0.011
    )
