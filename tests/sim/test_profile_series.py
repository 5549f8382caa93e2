"""bench sim's profile per configuration: the grid measured before and after each real run with one engine kept
loaded (`sim.measure.Profiler`, the staircase grid), and the profile fitted to both sides of the run."""

from __future__ import annotations

import pytest
from specfleet.bench.sim_profiles import ProfileSeries, drift
from specfleet.sim.measure import Grid, Profiler
from specfleet.sim.profile import Profile, StepPoint

MODEL = "bundled://smollm2-135m-instruct"


def test_drift_is_each_points_after_over_before():
    before = [StepPoint(1, 0, 32, 0, 0.020), StepPoint(32, 0, 1024, 0, 0.100)]
    after = [StepPoint(1, 0, 32, 0, 0.030), StepPoint(32, 0, 1024, 0, 0.090)]
    assert drift(before, after) == {"median_pct": 20.0, "min_pct": -10.0, "max_pct": 50.0}
    assert drift([], []) == {}


def test_a_fixed_profile_prices_every_configuration_as_it_is():
    fixed = Profile("p", "measured", False, ((1, 0.02), (32, 0.1)))
    series = ProfileSeries(MODEL, block_size=16, fixed=fixed)
    assert series.measure() is None and series.before() is fixed
    assert series.around() == (fixed, {"measured": "fixed (--profile)"})


@pytest.mark.slow
def test_the_staircase_measures_every_point_of_the_grid_and_the_series_fits_both_sides_of_a_run():
    """One engine, the grid twice: every (context, batch, k) point at its batch (the largest prefilled once,
    then cut down), the mixed prefill beside each batch, no request left behind; the configuration's
    profile is fitted to the points of both measurements and the record says how far they moved."""
    grid = Grid(
        batches=(1, 4), contexts=(24,), ks=(0, 2), prefills=(16,), steps=2, staircase=True, mixed_prefill=12
    )
    profiler = Profiler(MODEL, "ngram", 2, 0.05)
    series = ProfileSeries(MODEL, block_size=16, profiler=profiler, grid=grid)
    first = series.measure()
    assert first is not None and not profiler.engine.has_unfinished_requests()
    assert profiler.engine.kv_blocks_in_use() == 0
    # batches largest first, each: the mixed step, then k = 0 and k = 2; then the prefill point
    mixed4, plain4, spec4, mixed1, plain1, spec1, prefill = first.points
    assert (mixed4.decode_tokens, mixed4.prefill_tokens) == (4, 12)
    assert (mixed1.decode_tokens, mixed1.prefill_tokens) == (1, 12)
    assert (plain4.decode_tokens, plain4.verify_seqs) == (4, 0) and (
        plain1.decode_tokens,
        plain1.verify_seqs,
    ) == (1, 0)
    assert spec4.verify_seqs > 0 and spec4.draft_tokens > 0  # the repeating prompts give n-gram drafts
    assert plain4.context_tokens > 4 * 24  # the requests as timed: the prompt and what they generated since
    assert (prefill.decode_tokens, prefill.prefill_tokens) == (0, 16)
    assert series.before().points == tuple(first.points)

    profile, record = series.around()
    assert profile.points == tuple(first.points + series.measurements[1].points)
    assert record["points"] == 2 * len(first.points) and len(record["measure_s"]) == 2
    assert set(record["drift"]) == {"median_pct", "min_pct", "max_pct"}
    assert series.before().points == tuple(series.measurements[1].points)  # the next configuration's before
