"""Which InferenceService answers a model that several serve (a canary): by `routing.weight`. Pure: no I/O,
no clock, no randomness, so the tests can count exact splits.

- A request without a session id goes by smooth weighted round robin (nginx's `upstream` weights): each
  pick adds every service's weight to its credit and takes the one with the most, which then gives back
  the total. Over any run of `sum(weights)` picks each service gets exactly its weight, spread evenly
  rather than in bursts, and a weight change applies from the next pick.
- A request with a session id goes by weighted rendezvous hashing (highest random weight): each service
  scores `-weight / ln(u)` with `u` in (0, 1) from a hash of the session id and the service's key, and the
  highest score wins. A session keeps its service for as long as the set and the weights stay; over many
  sessions the shares follow the weights; a weight change moves only the sessions it must.
- Weight 0 takes a service out of the split (it is still listed, and reachable by its own name when it
  holds one alone); a model whose services all weigh 0 has nowhere to go (the gateway answers 503).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefix import stable_hash

# routing.weight's default and bounds (operator/spec/routing.py takes them from here): 100 leaves room for a 1%
# canary in whole numbers; 1000 for 0.1%.
DEFAULT_WEIGHT = 100
MAX_WEIGHT = 1000
_UNIT = 2.0**64  # stable_hash is 64-bit: u = (h + 0.5) / 2^64 lies strictly inside (0, 1)


@dataclass(frozen=True)
class Candidate:
    key: str  # the service, "namespace/name"
    weight: int


def session_pick(session: str, candidates: Sequence[Candidate]) -> str | None:
    """Weighted rendezvous hashing: the same session and the same weights give the same service."""
    best: tuple[float, str] | None = None
    for c in candidates:
        if c.weight <= 0:
            continue
        u = (stable_hash(f"{session}\0{c.key}") + 0.5) / _UNIT
        score = -c.weight / math.log(u)
        if best is None or (score, c.key) > best:
            best = (score, c.key)
    return None if best is None else best[1]


@dataclass
class SmoothWeighted:
    """Smooth weighted round robin over the services of one model; credits are kept per service key, so a
    service that leaves and comes back starts afresh and the others keep their place."""

    credit: dict[str, int] = field(default_factory=dict)

    def pick(self, candidates: Sequence[Candidate]) -> str | None:
        live = [c for c in candidates if c.weight > 0]
        if not live:
            return None
        keys = {c.key for c in live}
        for key in [k for k in self.credit if k not in keys]:
            del self.credit[key]
        total = sum(c.weight for c in live)
        for c in live:
            self.credit[c.key] = self.credit.get(c.key, 0) + c.weight
        # the first of the most credited, by key, wins a tie (nginx takes the first in its list)
        best = max(sorted(live, key=lambda c: c.key), key=lambda c: self.credit[c.key])
        self.credit[best.key] -= total
        return best.key


@dataclass
class WeightedSplit:
    """Per model name, the service a request goes to: sticky by session when one is given."""

    rotations: dict[str, SmoothWeighted] = field(default_factory=dict)

    def pick(self, model: str, candidates: Sequence[Candidate], session: str | None = None) -> str | None:
        if session:
            return session_pick(session, candidates)
        return self.rotations.setdefault(model, SmoothWeighted()).pick(candidates)
