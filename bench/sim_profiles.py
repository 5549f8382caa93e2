"""The profile each of bench sim's configurations is priced with: measured right before its real run and
again right after it, and fitted to both.

One profile at the bench's start priced every configuration's steps at the host's speed of that minute;
on this shared 2-core host the speed moves between runs minutes apart (bench sim, 2026-12-06: three quiet
runs within two hours, calibration factors 0.97-2.12, 0.90-0.98 and 0.65-0.84; in the last one the
start's profile timed a lone decode step at 31-37 ms where the engines' own lone steps took 22-23 ms a
few minutes later). So the grid is measured again between configurations, with one engine kept loaded
(`sim.measure.Profiler`), and each configuration's profile is the fit to the measurement before its run
and the one after it (the next configuration's before): the same host state, within a minute, on both
sides of the run. How far the two measurements moved apart is kept with the figures (`drift`).

The grid is the smallest that still fits the curve, measured on the three quiet profiles of 2026-12-06
(26 points each, k = 0, 2 and 4 x contexts 32 and 96 x batches 1, 4, 16 and 32, and prefills of 32 and
320 tokens; a subset's fit against the whole set's fit at every point of it): without k = 2, median 0.5-0.8 %
and worst 1.5-3.2 % on the two steady profiles; without batch 4, worst 18-25 % (the knot at 4 goes); with
one context, median 8-31 % (the context cost goes). So k = 0 and 4, both contexts, all four batches: 18
points. Its decode points come from one set of requests per context (`Grid.staircase`): the largest batch
prefilled once, then cut down, where the per-point grid prefilled each batch of its own.

At each batch the grid also times the step that prefills a 64-token prompt beside the batch's decodes
(`Grid.mixed_prefill`): that is how a request arriving at a busy engine gets its first token, and the fit
to plain decode steps and lone prefills priced it 18-24 % short (2026-12-06, 19:50, a loaded host: 670-957
ms measured against 541-784 predicted at batches 1-32, context 32), which the engines' TTFT, 9-21 % above
the simulated engines' in every configuration, showed. The fit now sees those steps.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from specfleet.sim.measure import Grid, Profiler
from specfleet.sim.profile import Profile, StepPoint, fit_error, fitted_profile

# k = 0 and 4 (the tuner's bounds in bench sim), both contexts and the four batches: the smallest grid whose
# fit stays within a few percent of the whole 26-point grid's (module docstring); 3 timed steps a point,
# as the start's profile had; a 64-token prompt beside each batch, the middle of the chat prompts (16-96)
MIXED_PROMPT = 64
QUICK_GRID = Grid(
    batches=(1, 4, 16, 32),
    contexts=(32, 96),
    ks=(0, 4),
    prefills=(32, 320),
    steps=3,
    staircase=True,
    mixed_prefill=MIXED_PROMPT,
)
FULL_GRID = Grid(
    batches=(1, 2, 4, 8, 16, 32),
    contexts=(32, 96),
    ks=(0, 2, 4),
    prefills=(32, 320),
    steps=4,
    staircase=True,
    mixed_prefill=MIXED_PROMPT,
)


@dataclass
class Measurement:
    points: list[StepPoint]
    seconds: float  # wall time the measurement took
    at: float  # when it ended (perf_counter)


@dataclass
class ProfileSeries:
    """Measurements between configurations and the profile fitted around each; or one fixed profile
    (`--profile`), which then prices every configuration as it is."""

    model: str
    block_size: int
    fixed: Profile | None = None
    profiler: Profiler | None = None
    grid: Grid = QUICK_GRID
    last: Measurement | None = None
    measurements: list[Measurement] = field(default_factory=list)

    def measure(self) -> Measurement | None:
        """The grid measured now (nothing with a fixed profile); it becomes the next configuration's before."""
        if self.profiler is None:
            return None
        started = time.perf_counter()
        points = self.profiler.points(self.grid, progress=False)
        done = time.perf_counter()
        self.last = Measurement(points, done - started, done)
        self.measurements.append(self.last)
        fit = fit_error(self.fitted([self.last]))
        print(
            f"profile: {len(points)} points in {done - started:.0f}s, fit {fit}", file=sys.stderr, flush=True
        )
        return self.last

    def fitted(self, measurements: list[Measurement]) -> Profile:
        if self.fixed is not None:
            return self.fixed
        assert self.profiler is not None
        return fitted_profile(
            "measured-bench-sim",
            [p for m in measurements for p in m.points],
            num_kv_blocks=self.profiler.num_kv_blocks,
            block_size=self.block_size,
            model=self.model,
            notes="measured by bench sim right before and right after the configuration's real run",
        )

    def before(self) -> Profile:
        """The profile of the measurement before the run (what the run's overhead phases are read with)."""
        return self.fitted([self.last]) if self.last is not None else self._fixed()

    def around(self) -> tuple[Profile, dict[str, Any]]:
        """Measure again (after the run) and fit to the measurements on both sides of it; with the record of
        the two: their times, the fit, and how far the after's steps moved from the before's."""
        if self.fixed is not None or self.last is None:
            return self._fixed(), {"measured": "fixed (--profile)"}
        before = self.last
        after = self.measure()
        assert after is not None
        profile = self.fitted([before, after])
        return profile, {
            "measured": "before and after the run",
            "points": len(before.points) + len(after.points),
            "measure_s": [round(before.seconds, 1), round(after.seconds, 1)],
            "fit": fit_error(profile),
            "drift": drift(before.points, after.points),
            "cpu": cpu_record(before.points + after.points),
            "knots_ms": [[round(d, 2), round(1000 * s, 2)] for d, s in profile.knots],
            "prefill_ms_per_token": round(1000 * profile.prefill_s_per_token, 3),
            "context_us_per_token": round(1e6 * profile.context_s_per_token, 2),
            "verify_ms_per_seq": round(1000 * profile.verify_s_per_seq, 3),
            "draft_ms_per_token": round(1000 * profile.draft_s_per_token, 3),
        }

    def _fixed(self) -> Profile:
        assert self.fixed is not None, "a measured series measures before its first configuration"
        return self.fixed


def drift(before: list[StepPoint], after: list[StepPoint]) -> dict[str, float]:
    """How the same grid's steps moved between two measurements: the median and the extremes of each point's
    after / before, in percent (the two lists are the same grid in the same order)."""
    ratios = [b.seconds / a.seconds - 1 for a, b in zip(before, after) if a.seconds > 0]
    if not ratios:
        return {}
    return {
        "median_pct": round(100 * statistics.median(ratios), 1),
        "min_pct": round(100 * min(ratios), 1),
        "max_pct": round(100 * max(ratios), 1),
    }


def cpu_record(points: list[StepPoint]) -> dict[str, float]:
    """How the measured steps' wall time stood against the CPU time that stepped them (issue 41), over the
    points that kept it: the median and the highest wall / thread CPU (well above 1: the measuring thread
    waited, descheduled or on other threads), the median process CPU / thread CPU (above 1: other threads
    of the process worked meanwhile), and the median and highest cores other processes kept busy."""
    timed = [p for p in points if p.cpu_s]
    if not timed:
        return {}
    waits = [p.seconds / (p.cpu_s or 1.0) for p in timed]
    others = [p.others_cores for p in timed if p.others_cores is not None]
    return {
        "wall_over_cpu_median": round(statistics.median(waits), 3),
        "wall_over_cpu_max": round(max(waits), 3),
        "process_over_thread_cpu_median": round(
            statistics.median((p.process_cpu_s or 0.0) / (p.cpu_s or 1.0) for p in timed), 3
        ),
        **(
            {
                "others_cores_median": round(statistics.median(others), 2),
                "others_cores_max": round(max(others), 2),
            }
            if others
            else {}
        ),
    }
