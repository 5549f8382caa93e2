"""The goodput model: what a config would do at the load observed now, from what was measured.

Step cost: one engine step over `n` tokens in the forward pass costs `t(n) = sqrt(c0^2 + (c1 * n)^2)`
seconds, a smooth roofline: `c0` is the memory-bound floor (the weights' traffic and per-op overhead,
paid once per step however few tokens it has), `c1` the compute cost per token once the step is
compute-bound (measured on the bundled 135M model, 2 CPU cores: 18 ms at 1 token, 30 ms at 8, 105 ms
at 32, 197 ms at 64; c0 = 18 ms, c1 = 3 ms fits within 10%). Prefill chunks are compute-bound and add
`c1` per prompt token on top.
A decode step with batch `B` and `k` speculative tokens processes about `B * (1 + p * k)` tokens, where
`p` is the share of sequence-steps that carried a proposal (n-gram finds no match on some), and emits
`B * (1 + p * E_k)` tokens with `E_k = sum_{i<k} a_i`, `a_i` = P(position i accepted) from the
per-position counters. Prefill rides along at the observed ratio of prompt tokens to output tokens.

Speculation pays below the knee `n = c0 / c1` (memory-bound decode, small batch: verifying k more
tokens costs little) and costs above it (large batch: every token costs compute). The model is only
used as a ratio against the config in force, so its absolute error cancels; each change is then
confirmed by measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..histogram import fraction_below
from ..types import SLO, Observation, TunedConfig
from .load import batch_per_engine, per_engine, step_tokens
from .params import ModelParams

DEFAULT = ModelParams()

# Ratios c1/c0 the fit tries, 1e-3 .. 1, ten per decade: from a GPU's knee at a thousand tokens to a
# step that is compute-bound from its first token; a tenth of a decade is finer than the fit's noise.
RATIOS = tuple(10 ** (e / 10) for e in range(-30, 1))


@dataclass(frozen=True)
class StepCost:
    c0: float  # seconds per step when memory-bound: the floor
    c1: float  # seconds per token when compute-bound

    def step(self, decode_tokens: float, prefill_tokens: float = 0.0) -> float:
        """Decode and verification tokens ride on the floor; prefill chunks are compute-bound."""
        return math.hypot(self.c0, self.c1 * max(decode_tokens, 1.0)) + self.c1 * max(prefill_tokens, 0.0)

    @property
    def knee(self) -> float:
        """Tokens per step where the step turns compute-bound."""
        return self.c0 / self.c1


def fit_step_cost(
    points: Sequence[tuple[float, float, float]], params: ModelParams = DEFAULT
) -> StepCost | None:
    """Fit `c0`, `c1` to (decode tokens per step, prefill tokens per step, step seconds) points.

    For each ratio `c1/c0` the scale is a closed-form least squares of relative error (so that 20 ms and
    200 ms steps weigh alike); the ratio with the least error wins when the points span at least a
    factor of 2 in decode tokens and it fits clearly better than the prior, else the prior ratio
    (`ModelParams.fit_*`).
    """
    pts = [(d, p, t) for d, p, t in points if d > 0 and t > 0]
    if not pts:
        return None

    def fit(ratio: float) -> tuple[float, float]:
        q = [(math.hypot(1.0, ratio * max(d, 1.0)) + ratio * max(p, 0.0)) / t for d, p, t in pts]
        c0 = sum(q) / sum(x * x for x in q)
        return sum((c0 * x - 1.0) ** 2 for x in q), c0

    ratio = prior = params.prior_cost_ratio
    decode = [d for d, _, _ in pts]
    if len(pts) >= params.fit_min_points and max(decode) >= params.fit_min_span * min(decode):
        best = min(RATIOS, key=lambda r: fit(r)[0])
        if fit(best)[0] < params.fit_min_gain * fit(prior)[0]:
            ratio = best
    c0 = fit(ratio)[1]
    return StepCost(c0, c0 * ratio)


def expected_accepted(per_pos: Sequence[float], k: int, params: ModelParams = DEFAULT) -> float:
    """E[accepted tokens | a draft of k]; the prior when nothing was measured; positions beyond those
    measured decay geometrically."""
    if k <= 0:
        return 0.0
    known = [max(0.0, min(1.0, a)) for a in per_pos]
    if not known:
        known = list(params.prior_acceptance)
    while len(known) < k:
        last = known[-1]
        ratio = known[-1] / known[-2] if len(known) >= 2 and known[-2] > 0 else params.decay_ratio
        known.append(last * min(ratio, params.max_decay_ratio))
    return sum(known[:k])


@dataclass(frozen=True)
class Prediction:
    config: TunedConfig
    batch: float  # sequences per step of one engine
    throughput: float  # output tokens/s of one engine
    tpot_s: float  # mean time per output token
    step_s: float
    waiting: float  # requests left waiting for a slot, per engine


@dataclass(frozen=True)
class LoadModel:
    """Everything about the current load the model needs: demand, acceptance, proposal share, prefill."""

    demand: float  # requests in the system, summed over the engines
    per_pos: tuple[float, ...]  # P(position i accepted | draft); () for the prior
    proposal_share: float  # share of sequence-steps that carried a draft when k > 0
    prefill_per_output: float  # prompt tokens computed per output token (prefill work scales with output)
    cost: StepCost
    engines: int = 1  # the demand is spread over them evenly; the prediction is per engine
    params: ModelParams = DEFAULT

    def predict(self, config: TunedConfig) -> Prediction:
        k = config.num_speculative_tokens
        batch = max(1.0, batch_per_engine(self.demand, self.engines, config.max_num_seqs))
        p = self.proposal_share if k > 0 else 0.0
        per_seq = 1.0 + p * expected_accepted(self.per_pos, k, self.params)
        step = self.cost.step(step_tokens(batch, k, p), batch * per_seq * self.prefill_per_output)
        return Prediction(
            config,
            batch,
            batch * per_seq / step,
            step / per_seq,
            step,
            max(0.0, per_engine(self.demand, self.engines) - config.max_num_seqs),
        )


def attainment(obs: Observation, slo: SLO, tpot_scale: float = 1.0, ttft_scale: float = 1.0) -> float | None:
    """Estimated share of requests meeting both targets, if latencies scaled by the given factors.

    Reads each target off the measured CDF at `target / scale` and assumes TTFT and TPOT independent.
    """
    tpot = fraction_below(obs.tpot_cdf, slo.tpot_p95_s / tpot_scale)
    ttft = fraction_below(obs.ttft_cdf, slo.ttft_p95_s / ttft_scale)
    if tpot is None and ttft is None:
        return None
    return (1.0 if tpot is None else tpot) * (1.0 if ttft is None else ttft)


def observed_goodput(obs: Observation, slo: SLO) -> float | None:
    """Output tokens/s of requests meeting the SLO (throughput times estimated attainment)."""
    share = attainment(obs, slo)
    if obs.generation_rate is None or share is None:
        return None
    return obs.generation_rate * share
