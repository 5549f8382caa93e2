"""Probes: changes made as measurements, where the model cannot tell. Each returns (config, why) or None,
and a change it proposes is judged by probation like any other (kept unless measured goodput drops).

- off: speculation off past the knee, where what proposing costs (a draft model's own passes) is invisible
  to a model of the target's step;
- up: a longer draft below the knee, while its last position is still accepted (acceptance past the
  measured positions is a guess);
- down: a shorter one when the last positions are rarely accepted (what such a token costs is below what
  the step-cost model resolves).
"""

from __future__ import annotations

from collections.abc import Callable

from ..types import Observation, TunedConfig
from . import reasons
from .load import batch_per_engine, step_tokens
from .params import PolicyParams

Tabooed = Callable[[TunedConfig, float | None], bool]  # (config, load) -> measured worse there
Probe = Callable[[TunedConfig, Observation, PolicyParams, float, Tabooed], tuple[TunedConfig, str] | None]


def probe_off(
    current: TunedConfig, obs: Observation, params: PolicyParams, knee: float, tabooed: Tabooed
) -> tuple[TunedConfig, str] | None:
    """Speculation off, to be measured, when the batch alone fills the step past the knee (compute-bound),
    so every proposed token costs compute, and the proposer's own cost is invisible to a model of the
    target's step. Not when k = 0 is already tabooed at this load."""
    if current.num_speculative_tokens == 0 or params.bounds.k[0] > 0:
        return None
    batch = batch_per_engine(obs.demand or 0.0, obs.engines, current.max_num_seqs)
    if batch < knee:
        return None
    off = current.with_(num_speculative_tokens=0)
    if tabooed(off, obs.demand):
        return None
    return off, reasons.probe_off(batch, knee)


def probe_up(
    current: TunedConfig, obs: Observation, params: PolicyParams, knee: float, tabooed: Tabooed
) -> tuple[TunedConfig, str] | None:
    """k up one bounded step, to be measured, when the model calls it a wash but cannot know: the drafts
    are still accepted at their last position (`up_probe_acceptance`), so positions past it are
    unmeasured, and the verification step is under the knee (memory-bound: more draft tokens cost little)."""
    k, high = current.num_speculative_tokens, params.bounds.k[1]
    acc = obs.accepted_per_pos
    if k == 0 or k >= high or len(acc) < k or acc[k - 1] < params.up_probe_acceptance:
        return None
    share = obs.proposal_share
    if share is None:
        return None
    seqs = current.max_num_seqs
    tokens = step_tokens(batch_per_engine(obs.demand or 0.0, obs.engines, seqs), k, share)
    if tokens >= knee:
        return None
    new_k = min(high, k + params.limits.max_k_step)
    budget = max(current.max_num_batched_tokens, round(step_tokens(seqs, new_k)))
    up = params.bounds.clamp(TunedConfig(new_k, seqs, budget))
    if tabooed(up, obs.demand):
        return None
    return up, reasons.probe_up(acc[k - 1], tokens, knee)


def probe_down(
    current: TunedConfig, obs: Observation, params: PolicyParams, knee: float, tabooed: Tabooed
) -> tuple[TunedConfig, str] | None:
    """The mirror of `probe_up`: the last position is rarely accepted (under `down_probe_start` of
    `down_probe_acceptance`), so drop the positions under `down_probe_acceptance` from the end (down to
    at least 1, and one bounded step), to be measured."""
    k, low = current.num_speculative_tokens, params.bounds.k[0]
    acc = obs.accepted_per_pos
    if (
        k <= max(1, low)
        or len(acc) < k
        or acc[k - 1] >= params.down_probe_acceptance * params.down_probe_start
    ):
        return None
    kept = max([i + 1 for i in range(k) if acc[i] >= params.down_probe_acceptance], default=1)
    new_k = max(kept, low, 1, k - params.limits.max_k_step)
    down = TunedConfig(new_k, current.max_num_seqs, current.max_num_batched_tokens)
    if tabooed(down, obs.demand):
        return None
    return down, reasons.probe_down(acc[k - 1])


PROBES: tuple[Probe, ...] = (
    probe_off,
    probe_up,
    probe_down,
)  # tried in this order; the first that fires wins
