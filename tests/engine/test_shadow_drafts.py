"""Shadow drafts: n-gram lookups scored against the tokens that follow, on steps that verify no drafts."""

from __future__ import annotations

from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.shadow import ShadowDrafts


def seq(seq_id: int, tokens: list[int], params: SamplingParams | None = None) -> Sequence:
    s = Sequence(
        seq_id,
        f"r{seq_id}",
        0,
        list(tokens),
        num_prompt_tokens=len(tokens) - 1,
        params=params or SamplingParams(),
    )
    s.num_computed_tokens = s.num_tokens - 1  # decoding: one token to feed
    return s


def emit(shadow: ShadowDrafts, s: Sequence, token: int) -> None:
    s.token_ids.append(token)
    s.num_computed_tokens += 1
    shadow.score([s])


def test_a_draft_counts_its_matched_prefix_once_a_token_differs():
    shadow = ShadowDrafts(length=4, n_min=1, n_max=3)
    s = seq(0, [1, 2, 3, 4, 1, 2])  # suffix [1, 2] occurred at the start: the draft is [3, 4, 1, 2]
    shadow.look([s])
    emit(shadow, s, 3)
    emit(shadow, s, 4)
    assert (shadow.stats.lookups, shadow.stats.drafts) == (0, 0)  # still being scored
    shadow.look([s])  # a sequence with a draft in flight gets no second lookup
    emit(shadow, s, 9)
    assert (shadow.stats.lookups, shadow.stats.drafts, shadow.stats.accepted_per_pos) == (1, 1, [1, 1, 0, 0])


def test_a_fully_matched_draft_counts_every_position_and_a_miss_counts_a_lookup_only():
    shadow = ShadowDrafts(length=2, n_min=1, n_max=2)
    s = seq(0, [5, 6, 7, 5])  # draft [6, 7]
    shadow.look([s])
    emit(shadow, s, 6)
    emit(shadow, s, 7)
    assert shadow.stats.accepted_per_pos == [1, 1] and shadow.stats.drafts == 1
    fresh = seq(1, [10, 11, 12])  # no earlier occurrence of any suffix: nothing to propose
    shadow.look([fresh])
    assert (shadow.stats.lookups, shadow.stats.drafts) == (2, 1)


def test_lookups_per_step_are_capped_and_skip_what_never_drafts():
    shadow = ShadowDrafts(length=2, n_min=1, n_max=2, per_step=2)
    penalised = seq(0, [1, 2, 1], SamplingParams(repetition_penalty=1.2))
    prefilling = seq(1, [1, 2, 1])
    prefilling.num_computed_tokens = 0
    busy, a, b, c = (seq(i, [1, 2, 1]) for i in range(2, 6))
    shadow.look([penalised, prefilling, busy, a, b, c], busy=frozenset({busy.seq_id}))
    assert set(shadow._pending) == {a.seq_id, b.seq_id}  # two lookups; c waits for the next step


def test_a_sequence_that_leaves_before_its_draft_is_scored_drops_it_uncounted():
    shadow = ShadowDrafts(length=4, n_min=1, n_max=3)
    s = seq(0, [1, 2, 3, 4, 1, 2])
    shadow.look([s])
    emit(shadow, s, 3)
    shadow.look([])  # it finished (or was preempted): no longer running
    emit(shadow, s, 9)
    assert (shadow.stats.lookups, shadow.stats.drafts) == (0, 0)
