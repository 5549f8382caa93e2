"""The scheduling policies: in what order waiting sequences are admitted, and which running one is preempted.

`fcfs` (the default): the waiting queue is first come, first served, and a preempted sequence goes back to
its front; the running sequence preempted when the KV cache is full is the last admitted.
`priority` (vLLM's `--scheduling-policy priority`): each request carries an int `priority`, lower values
first (vLLM's direction; 0 is the default), ties by arrival. The waiting queue is a heap on
`priority_key`, a preempted sequence keeping its key (so it resumes ahead of later arrivals of its
priority), and the running list is kept in key order so that its tail, the preemption victim, is the
lowest-priority latest arrival. Under this policy a waiting sequence of strictly higher priority also
preempts lower-priority running ones when the cache or `max_num_seqs` has no room for it
(`outranks`); equals never preempt each other, so nothing ping-pongs.

Plain Python: the simulator (sim/engine.py) runs the same `Scheduler`, and so the same rules.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from specfleet.engine.config import FCFS, PRIORITY, SCHEDULING_POLICIES

if TYPE_CHECKING:
    from specfleet.engine.sequence import Sequence

# The request field's range: msgpack (engine core messages) carries a signed 64-bit int, as vLLM's int.
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Lower runs first: the request's priority, then its arrival, then the sequence id (n > 1 samples of
    one request share a priority and arrive together)."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


def outranks(waiting: Sequence, running: Sequence) -> bool:
    """Whether a waiting sequence may preempt a running one to be admitted: priority only, strictly (as
    vLLM's fixes to its admission preemption compare, so that equals never preempt each other)."""
    return waiting.priority < running.priority


class WaitingQueue(Protocol):
    """The scheduler's waiting sequences, in admission order."""

    def add(self, seq: Sequence) -> None: ...  # a new arrival
    def add_preempted(self, seq: Sequence) -> None: ...  # back from the running list
    def put_back(self, seqs: list[Sequence]) -> None: ...  # popped, passed over this step, in pop order
    def peek(self) -> Sequence: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...
    def __contains__(self, seq: object) -> bool: ...


class FcfsQueue:
    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._q.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def put_back(self, seqs: list[Sequence]) -> None:
        self._q.extendleft(reversed(seqs))

    def peek(self) -> Sequence:
        return self._q[0]

    def pop(self) -> Sequence:
        return self._q.popleft()

    def remove(self, seq: Sequence) -> None:
        self._q.remove(seq)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)

    def __contains__(self, seq: object) -> bool:
        return seq in self._q


class PriorityQueue:
    """A heap on `priority_key`; iteration is in no particular order."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Sequence]] = []

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (priority_key(seq), seq))

    add_preempted = add  # its key is unchanged: it resumes ahead of later arrivals of its priority

    def put_back(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.add(seq)

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        self._heap = [item for item in self._heap if item[1] is not seq]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (item[1] for item in self._heap)

    def __contains__(self, seq: object) -> bool:
        return any(item[1] is seq for item in self._heap)


_QUEUES: dict[str, type[FcfsQueue] | type[PriorityQueue]] = {FCFS: FcfsQueue, PRIORITY: PriorityQueue}
if tuple(_QUEUES) != SCHEDULING_POLICIES:
    raise TypeError(f"request_queue has queues for {tuple(_QUEUES)}, config declares {SCHEDULING_POLICIES}")


def waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue of a policy; an unknown name is refused with the known ones."""
    try:
        return _QUEUES[policy]()
    except KeyError:
        raise ValueError(
            f"scheduling_policy={policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}"
        ) from None


def insert_running(running: list[Sequence], seq: Sequence, policy: str) -> None:
    """Add a sequence to the running list: at the end under fcfs (the tail is the latest admitted), in
    `priority_key` order under priority (the tail is the lowest-priority latest arrival)."""
    if policy == PRIORITY:
        bisect.insort(running, seq, key=priority_key)
    else:
        running.append(seq)
