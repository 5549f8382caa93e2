"""The n-gram lookup against the plain definition: every window of every n over the history."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view
from specfleet.engine.spec_decode.ngram import ngram_lookup


def reference(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # earlier n-grams, not the suffix itself
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=80),  # a small vocabulary: many partial matches
    st.integers(0, 8),
    st.integers(1, 4),
    st.integers(0, 4),
)
def test_lookup_equals_the_windowed_definition(tokens: list[int], k: int, n_min: int, extra: int) -> None:
    history = np.asarray(tokens, dtype=np.int64)
    assert ngram_lookup(history, k, n_min, n_min + extra) == reference(history, k, n_min, n_min + extra)


def test_the_longest_suffix_wins_over_a_later_shorter_match() -> None:
    history = np.asarray([7, 8, 9, 1, 5, 9, 2, 7, 8, 9], dtype=np.int64)
    assert ngram_lookup(history, 2, 1, 3) == [1, 5]  # "7 8 9" at the start, not the later lone "9"
    assert ngram_lookup(history, 2, 1, 1) == [2, 7]  # n = 1 only: the latest "9"
