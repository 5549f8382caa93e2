"""Speculation per request: finished requests grouped by the share of their draft tokens accepted.

Acceptance is a property of the request more than of the step: a request whose output copies its prompt
accepts nearly every draft its n-gram lookups find (and finds one nearly every step), one that writes new
text finds few drafts and accepts few (bench sim's copy prompts on the bundled model, 2026-12-06: requests
at 0.9-1.0 of their draft tokens accepted and drafts on 0.9-1.0 of their steps beside requests at 0-0.07 and
0.2). The engine-wide counters average the two kinds, which sets every request's TPOT to the mean where the
real ones fall in two groups. So each finished request that decoded is counted in one class, by the share
of its draft tokens accepted (`CLASSES` buckets of equal width; class 0: it verified no draft), with its
decoding steps, drafts, draft tokens and accepted tokens per position: per class the same counters as the
engine's totals, from which the simulator draws each request's class once (sim/profile.py
`AcceptanceClass`).

A decoding step of a request is a step that samples its next token(s) after its first (what a proposal
could have been made on, as the simulator's proposal share counts them). A request that ends without
finishing (an abort) is not counted; a preemption's recompute is no end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


# What the classes read of the engine's sequences and scheduler output, as protocols: the server's metrics
# import this module, and the operator theirs, which must not reach the engine's sequence (torch, through
# structured outputs)
class _Seq(Protocol):
    @property
    def seq_id(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def num_output_tokens(self) -> int: ...


class _Scheduled(Protocol):
    @property
    def seq(self) -> _Seq: ...
    @property
    def num_spec_tokens(self) -> int: ...
    @property
    def sample(self) -> bool: ...


class _Step(Protocol):
    @property
    def scheduled(self) -> Sequence[_Scheduled]: ...


# Buckets of the per-request acceptance (accepted / draft tokens): tenths, fine enough to keep the copy and
# free-text requests of one workload apart and few enough for a labelled counter (11 series with class 0)
CLASSES = 10
# the server's counters of the classes (engine/server/metrics.py), labelled `class` (0 to CLASSES): this prefix,
# then a `RequestCounts` field (`COUNTED`) and `_total`, or `accepted_tokens_per_pos` (labelled `position`)
METRIC_PREFIX = "specfleet_spec_decode_class_"
COUNTED = ("requests", "decode_steps", "drafts", "draft_tokens")


@dataclass
class RequestCounts:
    """Speculation counters of one request, or summed over a class of finished requests."""

    requests: int = 0
    decode_steps: int = 0  # steps that sampled a token after the request's first
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # drafts whose first i + 1 tokens came out

    def add(self, other: RequestCounts) -> None:
        self.requests += other.requests
        self.decode_steps += other.decode_steps
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        while len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.append(0)
        for pos, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[pos] += n


def class_of(counts: RequestCounts) -> int:
    """0 for a request that verified no draft, else 1 + the tenth of its draft tokens accepted (1.0 in the
    last)."""
    if not counts.draft_tokens:
        return 0
    return 1 + min(CLASSES - 1, int(CLASSES * counts.accepted_tokens / counts.draft_tokens))


class RequestClasses:
    """The engine's per-class totals (`classes[c]`), fed each step's scheduled work and its outcome."""

    def __init__(self) -> None:
        self.classes = [RequestCounts() for _ in range(CLASSES + 1)]
        # seq_id -> the sequence and its counters, until it ends
        self._running: dict[int, tuple[_Seq, RequestCounts]] = {}

    def observe(self, sched: _Step, changed: Sequence[tuple[_Seq, int]]) -> None:
        """A step's outcome: `changed` holds each sequence that gained tokens and how many. Sequences that
        ended since the last step are counted in their class (an abort is dropped uncounted)."""
        gained = {seq.seq_id: n for seq, n in changed}
        for item in sched.scheduled:
            seq = item.seq
            n = gained.get(seq.seq_id, 0)
            if not item.sample or not n or seq.num_output_tokens - n < 1:
                continue  # a prompt chunk, or the step that sampled the first token
            entry = self._running.get(seq.seq_id)
            if entry is None:
                entry = self._running[seq.seq_id] = (seq, RequestCounts(requests=1))
            counts = entry[1]
            counts.decode_steps += 1
            if item.num_spec_tokens:
                accepted = n - 1
                counts.drafts += 1
                counts.draft_tokens += item.num_spec_tokens
                counts.accepted_tokens += accepted
                while len(counts.accepted_per_pos) < item.num_spec_tokens:
                    counts.accepted_per_pos.append(0)
                for pos in range(accepted):
                    counts.accepted_per_pos[pos] += 1
        ended = [seq_id for seq_id, (seq, _) in self._running.items() if seq.is_finished]
        for seq_id in ended:
            seq, counts = self._running.pop(seq_id)
            if seq.finish_reason != "abort":
                self.classes[class_of(counts)].add(counts)
