"""Shadow drafts: what n-gram speculation would accept on steps that verify no drafts.

With speculation off (k = 0, or disabled by batch size) the engine verifies nothing, so nothing tells a
tuner whether turning it on would pay for the traffic of the moment; what it remembers from drafts
verified earlier may come from other prompts. The n-gram lookup is cheap and needs no model, so on such
steps a few decoding sequences get one lookup each, and the draft it finds is scored against the tokens
the target then emits, one per step: position `i` counts as accepted when the draft's first `i + 1` tokens
all came out. That is the acceptance a verified draft would have had, in distribution: the target accepts
a point-mass draft token with the probability it would have sampled it. A lookup that finds nothing counts
as a sequence-step without a proposal, as it would with speculation on. A draft is as long as a verified
one would be at that point (`rules.k_room`: the output left before `max_tokens`, the context left), so
every draft can be scored in full: a draft longer than the tokens still to come was dropped when its
sequence ended if it still matched and counted if it had failed, so near a sequence's end only the misses
counted (bench sim, 2026-12-06: at k = 4 the lookups ran on sequences' last steps only, and all eight
positions read 0 on prompts whose verified drafts accepted 0.66 at the first). A sequence with no room
gets no lookup, as it gets no draft with speculation on. A sequence that ends early (EOS, a stop string)
or is preempted before its draft is scored drops it uncounted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.ngram import ngram_lookup
from specfleet.engine.spec_decode.rules import LOOKUPS_PER_STEP, k_room, proposal_length


@dataclass
class ShadowStats:
    """Totals since start (the engine's counters)."""

    length: int  # positions scored: a draft's longest
    lookups: int = 0  # lookups scored: found a draft or not
    drafts: int = 0  # of those, lookups that found one
    accepted_per_pos: list[int] = field(init=False)  # drafts whose first i + 1 tokens came out

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.length

    def add(self, accepted: int) -> None:
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class _Pending:
    start: int  # the sequence's length at the lookup: the draft's tokens are those after it
    draft: list[int]


class ShadowDrafts:
    def __init__(
        self, length: int, n_min: int, n_max: int, max_model_len: int, per_step: int = LOOKUPS_PER_STEP
    ) -> None:
        self.length, self.n_min, self.n_max, self.per_step = length, n_min, n_max, per_step
        self.max_model_len = max_model_len
        self.stats = ShadowStats(length)
        self._pending: dict[int, _Pending] = {}  # seq_id -> its draft being scored

    def look(self, running: list[Sequence], busy: frozenset[int] = frozenset()) -> None:
        """Up to `per_step` lookups for decoding sequences of `running` without a draft being scored."""
        alive = {seq.seq_id for seq in running}
        self._pending = {sid: p for sid, p in self._pending.items() if sid in alive}
        looked = 0
        for seq in running:
            if looked == self.per_step:
                break
            if seq.seq_id in self._pending or seq.seq_id in busy or seq.in_prefill:
                continue
            params = seq.params
            if (
                params.depends_on_history
                or seq.grammar is not None
                or seq.num_output_tokens < params.min_tokens
            ):
                continue  # never drafted with speculation on either
            left = None if params.max_tokens is None else params.max_tokens - seq.num_output_tokens
            length = proposal_length(
                self.length, k_room(self.max_model_len, seq.num_tokens, left), self.length
            )
            if not length:
                continue  # no room for a draft: none with speculation on either
            looked += 1
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            draft = ngram_lookup(tokens, length, self.n_min, self.n_max)
            if draft:
                self._pending[seq.seq_id] = _Pending(seq.num_tokens, draft)
            else:
                self.stats.lookups += 1

    def score(self, grown: list[Sequence]) -> None:
        """Compare the drafts of the sequences that gained tokens with what they gained; a draft is
        counted once a token differs or all of it came out."""
        for seq in grown:
            pending = self._pending.get(seq.seq_id)
            if pending is None:
                continue
            emitted = seq.token_ids[pending.start : pending.start + len(pending.draft)]
            matched = 0
            while matched < len(emitted) and emitted[matched] == pending.draft[matched]:
                matched += 1
            if matched < len(emitted) or matched == len(pending.draft):
                del self._pending[seq.seq_id]
                self.stats.lookups += 1
                self.stats.drafts += 1
                self.stats.add(matched)
