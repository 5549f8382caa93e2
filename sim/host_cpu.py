"""What the host's cores did while `specfleet profile` timed a point: the CPU time the measuring process
took and what every other process took meanwhile, so that a profile point's wall time can be read against
the work it did (issue 41: the profile's decode steps priced 1.1-1.35x slower than the engines ran them).

`/proc/stat` counts in clock ticks (100 a second here): over a point's timed steps (75 ms to 1 s on the
2-core host) `others_cores` is good to about one tick over the span, e.g. +-0.13 cores over 75 ms. Where
there is no /proc (not Linux) it is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time


def host_busy_s() -> float | None:
    """The host's CPU seconds spent not idle since boot, all cores (None where /proc/stat is missing)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    jiffies = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / CLOCK_TICKS


@dataclass(frozen=True)
class Span:
    """The start of a measured span: wall clock, the host's busy CPU and this process's CPU (all threads)."""

    wall: float
    host_busy: float | None
    process_cpu: float

    @classmethod
    def start(cls) -> Span:
        return cls(time.perf_counter(), host_busy_s(), time.process_time())

    def others_cores(self) -> float | None:
        """Cores other processes kept busy since the start (the host's busy CPU less this process's, over
        the wall time); None without /proc."""
        busy = host_busy_s()
        if busy is None or self.host_busy is None:
            return None
        wall = max(time.perf_counter() - self.wall, 1e-9)
        mine = time.process_time() - self.process_cpu
        return max(0.0, (busy - self.host_busy - mine) / wall)
