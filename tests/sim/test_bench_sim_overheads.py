"""bench sim's request overhead, read on a real engine server: lone one-token requests' TTFT minus the engine's
own step over them, whatever the profile says of that prefill."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import start_server, stop_process
from specfleet.bench.sim import overheads, real_mix
from specfleet.sim.profile import Profile

pytestmark = pytest.mark.slow


def test_the_request_overhead_is_the_path_outside_the_engines_step_whatever_the_profile_prices(
    tmp_path: Path,
) -> None:
    """The profile's prediction for the lone requests' prefill stood in for the engine's own step, and a
    profile that priced it longer than the whole TTFT left the overhead at 0 (bench sim, 2026-12-06: 0 in
    every configuration of the quiet runs). Here the profile prices a prefill token at a second, and the
    overhead is still the path the engine's own step does not hold: positive, below the TTFT."""
    slow = Profile("slow", "measured", False, ((1, 1.0),), prefill_s_per_token=1.0)
    proc, url = start_server(tmp_path / "server.log")
    try:
        request, _, _, seen = asyncio.run(overheads(url, [url], slow))
        mix = asyncio.run(real_mix([url]))
    finally:
        stop_process(proc)
    assert seen["profile_first_step_ms"] == 9000.0  # 1 s for the step, 8 prompt tokens at 1 s
    assert 0 < seen["first_core_step_ms"] < seen["first_ttft_ms"] < 2000
    assert 0 < request * 1000 < seen["first_ttft_ms"]
    # the TTFT less the engine's step, less the server's work on the first token where it showed (>= 0)
    assert request * 1000 <= seen["first_ttft_ms"] - seen["first_core_step_ms"] + 0.1  # the figures' rounding
    # the engine core's time between back-to-back steps, as bench sim records it (`step_gap_ms`): the burst's
    # decode steps ran back to back, and the core's loop between them is a sliver of a step
    assert mix.steps > 0 and 0 < mix.gap_per_step() < 0.5 * mix.seconds / mix.steps
