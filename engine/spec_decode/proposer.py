"""The proposer interface: cheap guesses of the next k tokens, verified by one target pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from specfleet.engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, vocab] the draft's distribution; None: a point mass (n-gram)


class Proposer(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """At most ks[i] tokens for seqs[i] (fewer, or none, when it has no good guess)."""

    def release(self, seq: Sequence) -> None:
        """Forget a sequence (finished, aborted or preempted) and return whatever it held."""
