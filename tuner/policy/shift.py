"""Step 3, the load shift, where the knee decides alone without a window at one load, and the guard: the
same rule for a rise, moved into the engines (`speculative_disable_by_batch_size`).

A load that rose past the knee with speculation on, where every proposed token costs compute (at
concurrency 32 a draft of 6 cut goodput to 0.4x on 2 CPU cores), turns speculation off now; one that fell
under it with speculation off turns it on, if the model predicts a gain at the new load.
"""

from __future__ import annotations

import math

from ..types import Observation, TunedConfig
from .candidates import candidates
from .load import batch_per_engine, per_engine, rise_at
from .memory import Memory
from .params import PolicyParams
from .probes import Tabooed


def off_on_rise(
    current: TunedConfig, obs: Observation, load: float, knee: float, params: PolicyParams, tabooed: Tabooed
) -> TunedConfig | None:
    """Speculation off, when the batch at `load` requests in the system is at or past the knee."""
    off = current.with_(num_speculative_tokens=0)
    if (
        current.num_speculative_tokens > 0
        and params.bounds.k[0] == 0
        and batch_per_engine(load, obs.engines, current.max_num_seqs) >= knee
        and not tabooed(off, load)
    ):
        return off
    return None


def on_on_fall(
    current: TunedConfig,
    obs: Observation,
    load: float,
    knee: float,
    params: PolicyParams,
    memory: Memory,
    tabooed: Tabooed,
) -> tuple[TunedConfig, float] | None:
    """The mirror of `off_on_rise`: the load fell under the knee (memory-bound, where drafts are cheap)
    with k = 0. The shortest k the model predicts within `shift_on_tie` of the best at the new load
    (acceptance as remembered for such a load, else the prior), with its predicted gain, if it clears
    the dead band; None otherwise."""
    if (
        current.num_speculative_tokens > 0
        or params.bounds.k[1] == 0
        or load < 1.0
        or batch_per_engine(load, obs.engines, current.max_num_seqs) >= knee
    ):
        return None
    model = memory.model_at(obs, load, params)
    if model is None:
        return None
    here = model.predict(current).throughput
    options = [
        c
        for c in candidates(current, obs, params.slo, params.bounds, params.limits)
        if c.num_speculative_tokens > 0 and c.max_num_seqs == current.max_num_seqs and not tabooed(c, load)
    ]
    if not options or here <= 0:
        return None
    predicted = [(model.predict(c).throughput, c) for c in options]
    top = max(t for t, _ in predicted)
    # the shortest draft predicted within `shift_on_tie` of the best (see PolicyParams)
    throughput, best = min(
        ((t, c) for t, c in predicted if t >= (1.0 - params.shift_on_tie) * top),
        key=lambda tc: tc[1].num_speculative_tokens,
    )
    gain = throughput / here - 1.0
    return (best, gain) if gain > params.dead_band else None


def manages_guard(params: PolicyParams) -> bool:
    """Whether the engines' speculative_disable_by_batch_size is the policy's to set (not with k pinned
    to 0: there is nothing to disable)."""
    return params.guard and params.bounds.k[1] > 0


def guard_at(load: float, engines: int, knee: float, current: TunedConfig, params: PolicyParams) -> int:
    """`speculative_disable_by_batch_size` at a window's mean of `load` requests in the system, spread
    over `engines`: one under the smallest batch at which `off_on_rise` would turn speculation off (the
    smallest count `shifting` calls a rise, at or past the knee), so the engine does at its next step what
    the tuner would do at its next interval. 0 (never) when that batch is past max_num_seqs, or with
    `guard` off."""
    if not manages_guard(params):
        return 0
    off_at = max(math.ceil(knee), math.ceil(per_engine(rise_at(load, params), engines)))
    return 0 if off_at > current.max_num_seqs else off_at - 1
