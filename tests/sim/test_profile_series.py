"""bench sim's profile per configuration: the grid measured before and after each real run with one engine kept
loaded (`sim.measure.Profiler`, the staircase grid), and the profile fitted to both sides of the run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from specfleet.bench.sim_profiles import ProfileSeries, cpu_record, drift
from specfleet.engine.python_child import python_command
from specfleet.sim.host_cpu import CLOCK_TICKS, Span, host_busy_s
from specfleet.sim.measure import Grid, Profiler
from specfleet.sim.profile import Profile, StepPoint

MODEL = "bundled://smollm2-135m-instruct"


def test_drift_is_each_points_after_over_before():
    before = [StepPoint(1, 0, 32, 0, 0.020), StepPoint(32, 0, 1024, 0, 0.100)]
    after = [StepPoint(1, 0, 32, 0, 0.030), StepPoint(32, 0, 1024, 0, 0.090)]
    assert drift(before, after) == {"median_pct": 20.0, "min_pct": -10.0, "max_pct": 50.0}
    assert drift([], []) == {}


def test_the_cpu_record_reads_wall_against_the_cpu_that_stepped():
    points = [
        StepPoint(1, 0, 32, 0, 0.040, cpu_s=0.020, process_cpu_s=0.020, others_cores=0.5),
        StepPoint(4, 0, 128, 0, 0.030, cpu_s=0.030, process_cpu_s=0.033, others_cores=0.0),
        StepPoint(32, 0, 1024, 0, 0.100, cpu_s=0.080, process_cpu_s=0.080, others_cores=1.5),
        StepPoint(8, 0, 64, 0, 0.050),  # a point from a file before the CPU fields: left out
    ]
    assert cpu_record(points) == {
        "wall_over_cpu_median": 1.25,
        "wall_over_cpu_max": 2.0,
        "process_over_thread_cpu_median": 1.0,
        "others_cores_median": 0.5,
        "others_cores_max": 1.5,
    }
    assert cpu_record(points[3:]) == {}


def test_a_profile_keeps_its_points_cpu_and_older_files_load_without_it(tmp_path):
    point = StepPoint(1, 0, 32, 0, 0.040, cpu_s=0.020, process_cpu_s=0.021, others_cores=0.25)
    profile = Profile("p", "measured", False, ((1, 0.04), (32, 0.1)), points=(point,))
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").points == (point,)
    old = profile.to_json()
    old["points"] = [
        {k: v for k, v in p.items() if k not in ("cpu_s", "process_cpu_s", "others_cores")}
        for p in old["points"]
    ]
    assert Profile.from_json(old).points[0].cpu_s is None


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds (user and system, all threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


# /proc counts in clock ticks (10 ms here) and samples a process's CPU at them: a few ticks of slack for the
# host's and each process's count over a span, far below the 0.3 s each case turns on
SAMPLING_S = 0.05


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")
def test_a_span_counts_another_process_busy_and_not_its_own():
    """A child spinning on a core while this process sleeps shows in `others_cores`; this process's own
    work over a span does not. Other processes on this shared host add to either span as they please, so
    each case is held against what /proc says of the processes in it, not against the other span: the
    child's own CPU time over the span is a floor for what the others did, and what the others did is at
    most the host's busy time around the span less this process's CPU time inside it."""
    child = subprocess.Popen(
        python_command("-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass")
    )
    try:
        span = Span.start()
        spun = _cpu_s(child.pid)
        deadline = time.monotonic() + 50
        while _cpu_s(child.pid) - spun < 0.3:  # the child's 0.3 s of CPU, however long the host takes
            assert time.monotonic() < deadline and child.poll() is None, "the child did not spin"
            time.sleep(0.05)
        spun = _cpu_s(child.pid) - spun
        others = span.others_cores()
        outer = time.perf_counter() - span.wall  # the span's wall time or a little more
    finally:
        child.kill()
        child.wait()
    assert others is not None and others * outer >= spun - SAMPLING_S, (others, outer, spun)

    busy = host_busy_s()
    span = Span.start()
    mine = time.process_time()
    while time.process_time() - mine < 0.3:
        pass
    mine = time.process_time() - mine
    inner = time.perf_counter() - span.wall  # the span's wall time or a little less
    others = span.others_cores()
    busy_after = host_busy_s()
    assert busy is not None and busy_after is not None and others is not None
    # counted as the others' work, this process's 0.3 s would put it above the host's busy time less them
    assert others * inner <= busy_after - busy - mine + SAMPLING_S, (others, inner, busy_after - busy, mine)


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
    for point in first.points:  # each point keeps the CPU that stepped it beside its wall time
        assert point.cpu_s is not None and 0 < point.cpu_s <= point.seconds * 1.05
        assert point.process_cpu_s is not None and point.process_cpu_s >= 0.9 * point.cpu_s
        assert point.others_cores is None or point.others_cores >= 0

    profile, record = series.around()
    assert profile.points == tuple(first.points + series.measurements[1].points)
    assert record["points"] == 2 * len(first.points) and len(record["measure_s"]) == 2
    assert set(record["drift"]) == {"median_pct", "min_pct", "max_pct"}
    assert record["cpu"]["wall_over_cpu_median"] >= 0.95
    assert series.before().points == tuple(series.measurements[1].points)  # the next configuration's before
