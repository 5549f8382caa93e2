"""The load's shared quantities, each computed here and nowhere else: the batch each engine runs, the
tokens of a step, when two loads count as one, and when the load is shifting.

The sources report sums over the engines (requests in the system, rates); the router spreads requests
evenly (least outstanding), so everything the step cost decides is per engine.
"""

from __future__ import annotations

import math

from ..types import Observation
from .params import PolicyParams


def per_engine(load: float, engines: int) -> float:
    """Requests in the system per engine, for `load` summed over `engines`."""
    return load / engines


def batch_per_engine(load: float, engines: int, max_num_seqs: int) -> float:
    """Sequences in each engine's step at `load` requests in the system: the rest wait for a slot."""
    return min(per_engine(load, engines), float(max_num_seqs))


def adapter_cap(obs: Observation, current_seqs: int) -> int | None:
    """The most max_num_seqs the search may take while adapter slots bind (more adapters in demand per
    engine than --max-loras): the requests per engine the slots let into a batch (`lora_runnable_share`),
    rounded up, or the value in force if higher (the cap never lowers it). None: the slots do not bind."""
    share = obs.lora_runnable_share
    if share >= 1.0 or obs.demand is None:
        return None
    return max(current_seqs, math.ceil(per_engine(obs.demand * share, obs.engines)))


def step_tokens(batch: float, k: int, proposal_share: float = 1.0) -> float:
    """Tokens in a decode step's forward pass: each sequence's next token, plus its draft of `k` on the
    share of sequence-steps that carry one. A step runs at least one sequence."""
    return max(batch, 1.0) * (1.0 + proposal_share * k)


def similar(a: float | None, b: float | None, params: PolicyParams) -> bool:
    """Two loads (requests in the system) that count as one; an unknown load is like any."""
    if a is None or b is None:
        return True
    return abs(a - b) <= params.similar_load * max(a, b, 1.0)


def shifting(before: float, after: float, params: PolicyParams) -> bool:
    """The load moved within the window: the count now (`after`) is far from the window's mean (`before`)."""
    return abs(after - before) >= max(params.shift_requests, params.shift_share * max(before, after))


def rise_at(load: float, params: PolicyParams) -> float:
    """The smallest count above a window's mean `load` that `shifting` calls a shift: `shift_requests`
    more, and a rise of `shift_share` of the new count (twice the load at one half)."""
    return max(load + params.shift_requests, load / (1.0 - params.shift_share))
