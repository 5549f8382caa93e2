"""Shadow drafts on a simulated engine: what the engine's n-gram lookups on steps that verify no drafts
(engine/spec_decode/shadow.py) report to the tuner, drawn from the proposer's acceptance on the workload.

The real tuner reads speculation's worth from these counters while k is 0 (tuner/policy/memory.py); a
simulated engine without them left the simulated tuner on its prior acceptance, so the two decided
differently on the same workload (bench sim, 2026-12-03: the real one kept k = 0, the simulated one chose
k = 2). As the engine: on a step without drafts, up to `LOOKUPS_PER_STEP` decoding sequences without a
pending draft get one lookup each; a lookup finds a draft with the proposal share, and the draft is scored
up to its full length (the engine's ceiling for k), position i accepted with P(position i accepted | a
draft). A drafted sequence gets no new lookup until its draft would be scored (its tokens emitted, or the
first mismatch). The lookup is counted at once rather than when scored: the same counts in distribution.
"""

from __future__ import annotations

import random

from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.rules import LOOKUPS_PER_STEP


class SimShadow:
    def __init__(self, length: int, conditional: list[float], share: float, rng: random.Random) -> None:
        self.length, self.conditional, self.share, self.rng = length, conditional, share, rng
        self.lookups = 0  # lookups scored: found a draft or not (the engine's counters)
        self.drafts = 0  # of those, lookups that found one
        self.accepted_per_pos = [0] * length  # drafts whose first i + 1 tokens came out
        self._until: dict[int, int] = {}  # seq_id -> its length when its pending draft is scored

    def look(self, running: list[Sequence]) -> None:
        until = self._until
        if until:
            alive = {seq.seq_id for seq in running}
            self._until = until = {sid: n for sid, n in until.items() if sid in alive}
        looked = 0
        for seq in running:
            if looked == LOOKUPS_PER_STEP:
                break
            if seq.in_prefill or until.get(seq.seq_id, 0) > seq.num_tokens:
                continue
            looked += 1
            self.lookups += 1
            if self.share < 1.0 and self.rng.random() >= self.share:
                continue  # the lookup found no earlier match
            accepted = 0
            while (
                accepted < self.length
                and self.rng.random() < self.conditional[min(accepted, len(self.conditional) - 1)]
            ):
                accepted += 1
            self.drafts += 1
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1
            until[seq.seq_id] = seq.num_tokens + min(accepted + 1, self.length)
