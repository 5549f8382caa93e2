"""Each simulated request's own speculation draws: its class of acceptance dealt from a shuffled deck of the
measured classes, and a random stream of its own for its proposals and their acceptance.

Both depend on the request's index in the trace and the fleet's seed only, not on when its steps ran. One
engine-wide generator drew them before, in the order the steps came, so any change of a step's cost (bench
sim's calibration factor) dealt other classes to later requests: on bench sim's copy-1e-spec trace (29
requests, classes of 0.2 to 1.0 acceptance whose TPOTs differ about threefold) the simulated TPOT p50 of one
profile ranged 12.4-27.0 ms over 20 seeds, and moved -34 % to +10 % under decode factors 0.88-1.02 that change
each step's cost by at most 12 % (2026-12-06, both saved quiet runs): the calibration looked as if it moved
TPOT away where the draws had moved.

The deck holds each class as many times as the engine counted requests in it, shuffled once per deck's worth
of requests: a trace of the measured length gets the measured mix exactly (independent draws left the median
request to chance where it sits between the fast and the slow classes).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

SEED_STRIDE = 1 << 32  # request indices below this never meet the next seed's (a trace has far fewer)


def request_rng(seed: int, index: int) -> random.Random:
    """The generator of request `index`'s proposals and acceptances under fleet seed `seed`."""
    return random.Random(seed * SEED_STRIDE + index)


class ClassDeck:
    """Classes dealt by request index: each block of `size` consecutive indices gets every class as many times
    as its weight (rounded, at least once), in an order shuffled per block from the seed."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"class weights {list(weights)} must be non-empty and > 0")
        self.cards = [i for i, w in enumerate(weights) for _ in range(max(1, round(w)))]
        self.size = len(self.cards)
        self.seed = seed
        self._block = -1
        self._order: list[int] = []

    def deal(self, index: int) -> int:
        """The class (its position in `weights`) of request `index`."""
        block, at = divmod(index, self.size)
        if block != self._block:  # requests come nearly in index order: one block at a time is enough
            self._order = list(self.cards)
            random.Random(f"deck {self.seed} {block}").shuffle(self._order)  # apart from `request_rng`'s
            self._block = block
        return self._order[at]
