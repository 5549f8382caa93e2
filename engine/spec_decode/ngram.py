"""Prompt lookup (n-gram) proposals: find the latest earlier occurrence of the sequence's last n tokens
in its own prompt and output, and propose what followed it. No model; numpy over the token history."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.proposer import Proposal


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens after the latest earlier match of the longest suffix n-gram (n_max down to n_min)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :]
        windows = sliding_window_view(tokens[: length - 1], n)  # earlier n-grams, excluding the suffix itself
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            out.append(Proposal(ngram_lookup(tokens, k, self.n_min, self.n_max) if k else []))
        return out

    def release(self, seq: Sequence) -> None:
        pass
