"""Prompt lookup (n-gram) proposals: find the latest earlier occurrence of the sequence's last n tokens
in its own prompt and output, and propose what followed it. No model; numpy over the token history."""

from __future__ import annotations

import numpy as np
from specfleet.engine.sequence import Sequence
from specfleet.engine.spec_decode.proposer import Proposal


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens after the latest earlier match of the longest suffix n-gram (n_max down to n_min).

    One pass over the history finds the earlier positions holding the last token; the longer suffixes
    are then checked on those candidates only (a few, on most text), one token back at a time: 4-9 us a
    lookup over 200-1000 tokens on 2 CPU cores, where comparing every window of every n read 0.2-0.5 ms
    (a shadow draft's or a real draft's lookup runs on every step)."""
    length = len(tokens)
    n_max = min(n_max, length - 1)
    if n_max < n_min:
        return []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # where an earlier n-gram would end
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens each candidate matches, up to n_max
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, n_max):
        before = ends - back
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - back]
        matched += alive
    for n in range(n_max, n_min - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            start = int(hits[-1]) + 1
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
