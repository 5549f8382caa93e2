"""Cores of their own for local engines, as the kubelet's static CPU manager gives a Guaranteed pod with an
integer CPU request exclusive cores: with `specfleet up --cpus-per-engine N` each engine is pinned
(sched_setaffinity) to N cores no other engine holds, and runs N threads (OMP_NUM_THREADS).

Without pinning every engine spreads its threads over every core, so a second replica on a small machine
adds a process but no compute: the replicas share the same cores. Pinned, one replica is N cores' worth of
capacity and a second one brings its own, the way a second GPU replica brings its own device. The cores an
engine holds are its for its lifetime (restarts included) and go back to the pool when it is retired.
When the pool has fewer free cores than asked, the engine shares the least-held ones and `take` says so.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


def machine_cores() -> frozenset[int]:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return frozenset(os.sched_getaffinity(0))


@dataclass
class CorePool:
    cores: frozenset[int] = field(default_factory=machine_cores)
    held: Counter[int] = field(default_factory=Counter)  # core -> engines pinned to it

    def __post_init__(self) -> None:
        if not self.cores:
            raise ValueError("a core pool needs at least one core")

    def check(self, n: int) -> None:
        if not 1 <= n <= len(self.cores):
            raise ValueError(
                f"cpus per engine={n} must be in [1, {len(self.cores)}] (the cores of this machine)"
            )

    def take(self, n: int) -> tuple[frozenset[int], bool]:
        """`n` cores, the least-held first (lowest number on ties); True when they are exclusive (none was
        held), False when the pool ran short and the engine shares some with another."""
        self.check(n)
        chosen = sorted(self.cores, key=lambda c: (self.held[c], c))[:n]
        exclusive = all(self.held[c] == 0 for c in chosen)
        self.held.update(chosen)
        return frozenset(chosen), exclusive

    def give_back(self, cores: frozenset[int]) -> None:
        for core in cores:
            if self.held[core] <= 0:
                raise ValueError(f"core {core} is not held")
            self.held[core] -= 1


@contextlib.contextmanager
def spawned_on(cores: frozenset[int] | None) -> Iterator[None]:
    """Processes this thread starts within it run on `cores` (None: as this thread does) from their first
    instruction, and so do the threads they start (torch's, the native kernels'). A child takes the affinity
    of the thread that forks it, and sched_setaffinity(0) sets the calling thread's alone, so no other
    thread of this process moves. Pinning the child after its start raced it: whatever the child did before
    the parent got round to it (a loaded host can keep a parent off the CPU that long), threads it started
    included, ran on every core."""
    if cores is None:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
