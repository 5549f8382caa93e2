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
    shadow = ShadowDrafts(length=4, n_min=1, n_max=3, max_model_len=1024)
    s = seq(0, [1, 2, 3, 4, 1, 2])  # suffix [1, 2] occurred at the start: the draft is [3, 4, 1, 2]
    shadow.look([s])
    emit(shadow, s, 3)
    emit(shadow, s, 4)
    assert (shadow.stats.lookups, shadow.stats.drafts) == (0, 0)  # still being scored
    shadow.look([s])  # a sequence with a draft in flight gets no second lookup
    emit(shadow, s, 9)
    assert (shadow.stats.lookups, shadow.stats.drafts, shadow.stats.accepted_per_pos) == (1, 1, [1, 1, 0, 0])


def test_a_fully_matched_draft_counts_every_position_and_a_miss_counts_a_lookup_only():
    shadow = ShadowDrafts(length=2, n_min=1, n_max=2, max_model_len=1024)
    s = seq(0, [5, 6, 7, 5])  # draft [6, 7]
    shadow.look([s])
    emit(shadow, s, 6)
    emit(shadow, s, 7)
    assert shadow.stats.accepted_per_pos == [1, 1] and shadow.stats.drafts == 1
    fresh = seq(1, [10, 11, 12])  # no earlier occurrence of any suffix: nothing to propose
    shadow.look([fresh])
    assert (shadow.stats.lookups, shadow.stats.drafts) == (2, 1)


def test_lookups_per_step_are_capped_and_skip_what_never_drafts():
    shadow = ShadowDrafts(length=2, n_min=1, n_max=2, max_model_len=1024, per_step=2)
    penalised = seq(0, [1, 2, 1], SamplingParams(repetition_penalty=1.2))
    prefilling = seq(1, [1, 2, 1])
    prefilling.num_computed_tokens = 0
    busy, a, b, c = (seq(i, [1, 2, 1]) for i in range(2, 6))
    shadow.look([penalised, prefilling, busy, a, b, c], busy=frozenset({busy.seq_id}))
    assert set(shadow._pending) == {a.seq_id, b.seq_id}  # two lookups; c waits for the next step


def test_a_sequence_that_leaves_before_its_draft_is_scored_drops_it_uncounted():
    shadow = ShadowDrafts(length=4, n_min=1, n_max=3, max_model_len=1024)
    s = seq(0, [1, 2, 3, 4, 1, 2])
    shadow.look([s])
    emit(shadow, s, 3)
    shadow.look([])  # it finished (or was preempted): no longer running
    emit(shadow, s, 9)
    assert (shadow.stats.lookups, shadow.stats.drafts) == (0, 0)


def test_near_a_sequence_end_a_draft_is_as_long_as_its_room_and_a_hit_counts_as_a_miss_does():
    """A draft longer than the tokens still to come could only fail before its sequence ended: a hit was
    dropped with the sequence, a miss counted, so drafts looked up near the end counted misses alone (bench
    sim 2026-12-06, copy-1e-spec at k = 4: every shadow lookup ran on a sequence's last steps, and all eight
    positions read 0 where the verified drafts accepted 0.66 at the first). Drafts are now as long as a
    verified one would be there (the k-room rule), and are scored in full either way."""
    shadow = ShadowDrafts(length=4, n_min=1, n_max=3, max_model_len=1024)
    last_two = SamplingParams(max_tokens=3)  # one output token so far: two to come, room for a 1-token draft
    hit, miss = seq(0, [1, 2, 3, 4, 1, 2], last_two), seq(1, [1, 2, 3, 4, 1, 2], last_two)
    shadow.look([hit, miss])
    assert [p.draft for p in shadow._pending.values()] == [[3], [3]]
    emit(shadow, hit, 3)
    emit(shadow, miss, 9)
    assert (shadow.stats.lookups, shadow.stats.drafts) == (2, 2)
    assert shadow.stats.accepted_per_pos == [1, 0, 0, 0]  # the hit counts: one of the two drafts accepted
    last = seq(2, [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=2))  # its last token: no room for a draft
    shadow.look([last])
    assert not shadow._pending and shadow.stats.lookups == 2  # no lookup, as no draft with k > 0 either
