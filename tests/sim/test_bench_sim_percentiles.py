"""bench sim takes the simulated side's percentiles as it takes the real side's (`pct`, the nearest rank), so
that on a few dozen requests both name a request's figure (issue 41: prefix-1e's simulated TTFT p95,
interpolated halfway between the 29th and 30th of 31 requests, 806 and 1198 ms, read 23.5 % off the real
811 ms, where its nearest rank was 0.6 % off)."""

from __future__ import annotations

import asyncio
from argparse import Namespace

from helpers import cpu_like_profile
from specfleet.bench.sim import _simulate, configs, isvc_doc, pct
from specfleet.operator import load_inference_service
from specfleet.sim.report import request_rows


def test_pct_is_the_nearest_rank_of_what_the_real_side_measured():
    values = [0.2] * 28 + [0.806, 1.198, 1.688]  # 31 requests, three queued behind prompts
    assert pct(values, 95) == 0.806 and pct(values, 50) == 0.2
    assert pct([3.0, 1.0, 2.0], 100) == 3.0 and pct([5.0], 95) == 5.0


def test_the_simulated_side_reports_its_requests_figures_not_points_between_them():
    config = next(c for c in configs(20.0) if c.name == "prefix-1e")
    isvc = load_inference_service(isvc_doc(config, 5.0))
    requests = list(config.workload.requests())
    profile = cpu_like_profile(num_kv_blocks=364)
    args = Namespace(interval=5.0, window=10.0)
    figures, run, _ = asyncio.run(_simulate(config, isvc, profile, args, requests, ()))
    rows = request_rows(run)
    ttft = sorted(r["ttft_s"] for r in rows)
    tpot = sorted(r["tpot_s"] for r in rows if r["tpot_s"] is not None)
    assert len(ttft) == figures["requests"] == 31
    assert figures["ttft_p95"] == ttft[28] and figures["ttft_p50"] == ttft[15]  # round(0.95 * 30) = 28
    assert figures["tpot_p95"] == tpot[round(0.95 * (len(tpot) - 1))]
    assert ttft[28] < ttft[29]  # where an interpolated p95 would have named no request
