"""Candidate configs one bounded step from the config in force, scored by predicted goodput, and the pick.

Predictions are ratios against the config in force, applied to what was measured under it: a candidate's
goodput is the observed throughput times the model's throughput ratio, times the SLO attainment read off
the observed latency CDFs scaled by the model's latency ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..types import SLO, Observation, TuneBounds, TunedConfig
from .load import step_tokens
from .model import LoadModel, attainment
from .params import StepLimits


@dataclass(frozen=True)
class Scored:
    config: TunedConfig
    goodput: float  # predicted output tokens/s meeting the SLO
    attainment: float  # predicted share of requests meeting the SLO
    tpot_p95_s: float | None  # predicted
    ttft_p95_s: float | None  # predicted


def _k_options(current: int, bounds: TuneBounds, limits: StepLimits) -> list[int]:
    low, high = bounds.k
    options = {
        k for k in range(current - limits.max_k_step, current + limits.max_k_step + 1) if low <= k <= high
    }
    if low == 0:
        options.add(0)
    return sorted(options or {max(low, min(high, current))})


def _seqs_options(current: int, bounds: TuneBounds, limits: StepLimits) -> list[int]:
    f = limits.max_seqs_factor
    raw = {
        current,
        round(current / f),
        round(current * f),
        *(round(current * x) for x in limits.seqs_factors),
    }
    low, high = bounds.max_num_seqs
    return sorted({max(low, min(high, max(1, s))) for s in raw})


def batched_tokens_for(
    k: int,
    seqs: int,
    current: TunedConfig,
    obs: Observation,
    slo: SLO,
    bounds: TuneBounds,
    limits: StepLimits,
) -> int:
    """The step token budget: room for every sequence's decode and draft tokens, grown while TTFT misses
    its target with TPOT to spare (more prefill per step), shrunk while TPOT misses (less prefill)."""
    budget = current.max_num_batched_tokens
    needed = round(step_tokens(seqs, k))
    ttft_over = obs.ttft_p95_s is not None and obs.ttft_p95_s > slo.ttft_p95_s
    tpot_over = obs.tpot_p95_s is not None and obs.tpot_p95_s > slo.tpot_p95_s
    tpot_spare = obs.tpot_p95_s is not None and obs.tpot_p95_s < limits.tpot_spare * slo.tpot_p95_s
    if ttft_over and tpot_spare and (obs.waiting or 0) > 0:
        budget = int(budget * limits.budget_grow)
    elif tpot_over and (obs.prompt_rate or 0) > (obs.generation_rate or 0):
        budget = int(budget * limits.budget_shrink)
    budget = max(budget, min(needed, int(limits.budget_room_factor * current.max_num_batched_tokens)))
    low, high = bounds.max_num_batched_tokens
    return max(low, min(high, budget))


def candidates(
    current: TunedConfig, obs: Observation, slo: SLO, bounds: TuneBounds, limits: StepLimits
) -> list[TunedConfig]:
    out = []
    for k in _k_options(current.num_speculative_tokens, bounds, limits):
        for seqs in _seqs_options(current.max_num_seqs, bounds, limits):
            tokens = batched_tokens_for(k, seqs, current, obs, slo, bounds, limits)
            out.append(bounds.clamp(TunedConfig(k, seqs, tokens)))
    return sorted(
        set(out), key=lambda c: (c.num_speculative_tokens, c.max_num_seqs, c.max_num_batched_tokens)
    )


def score(config: TunedConfig, current: TunedConfig, obs: Observation, slo: SLO, model: LoadModel) -> Scored:
    now = model.predict(current)
    new = model.predict(config)
    tpot_scale = new.tpot_s / now.tpot_s
    queue_now, queue_new = 1.0 + now.waiting / max(now.batch, 1.0), 1.0 + new.waiting / max(new.batch, 1.0)
    ttft_scale = (new.step_s / now.step_s) * (queue_new / queue_now)
    share = attainment(obs, slo, tpot_scale, ttft_scale)
    share = 1.0 if share is None else share
    throughput = (obs.generation_rate or now.throughput) * new.throughput / now.throughput
    return Scored(
        config,
        throughput * share,
        share,
        None if obs.tpot_p95_s is None else obs.tpot_p95_s * tpot_scale,
        None if obs.ttft_p95_s is None else obs.ttft_p95_s * ttft_scale,
    )


def distance(a: TunedConfig, b: TunedConfig) -> int:
    """Knobs that differ: among equally good candidates the one that changes least wins."""
    return sum(x != y for x, y in zip(a.as_admin().values(), b.as_admin().values(), strict=True))


def best(options: list[Scored], current: TunedConfig, limit_s: float, change_penalty: float) -> Scored | None:
    """The highest predicted goodput among the candidates predicted to keep TPOT p95 under `limit_s`, each
    knob changed costing `change_penalty` of it (near-ties go to the smaller change)."""
    safe = [s for s in options if s.tpot_p95_s is None or s.tpot_p95_s <= limit_s]
    return max(
        safe, key=lambda s: s.goodput * (1.0 - change_penalty * distance(s.config, current)), default=None
    )


def queues(config: TunedConfig, current: TunedConfig, requests_per_engine: float) -> bool:
    """Whether `config` cuts max_num_seqs below the requests each engine holds: fewer slots than requests
    leave some waiting, which lowers TPOT by moving the time into TTFT rather than adding capacity."""
    return config.max_num_seqs < min(current.max_num_seqs, requests_per_engine)


def fastest(options: list[Scored]) -> Scored | None:
    """The candidate predicted to lower TPOT most (then the one with more goodput)."""
    return min(options, key=lambda s: (s.tpot_p95_s or 0.0, -s.goodput), default=None)
