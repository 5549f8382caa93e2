"""The goodput model: what a config would do at the load observed now, from what was measured.

Step cost: one engine step over `n` tokens in the forward pass costs `t(n) = sqrt(c0^2 + (c1 * n)^2)`
seconds, a smooth roofline: `c0` is the memory-bound floor (the weights' traffic and per-op overhead,
paid once per step however few tokens it has), `c1` the compute cost per token once the step is
compute-bound (measured on the bundled 135M model, 2 CPU cores: 18 ms at 1 token, 30 ms at 8, 105 ms
at 32, 197 ms at 64; c0 = 18 ms, c1 = 3 ms fits within 10%). It is fitted as a line in `n^2`.
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

from .histogram import fraction_below
from .types import SLO, Observation, TunedConfig

# Prior for c1/c0 when the observed points do not span enough tokens per step to fit both: measured for
# the bundled 135M model on a 2-core CPU (c0 = 18 ms, c1 = 3 ms: the knee at 6 tokens). GPUs have a far
# smaller ratio (a knee at hundreds of tokens), which only makes the prior conservative about
# speculation there.
DEFAULT_COST_RATIO = 1 / 6
# Prior per-position acceptance before any draft was verified (n-gram on chat text, measured elsewhere).
PRIOR_ACCEPTANCE = (0.5, 0.35, 0.25, 0.18, 0.13, 0.1, 0.07, 0.05)


@dataclass(frozen=True)
class StepCost:
    c0: float  # seconds per step when memory-bound: the floor
    c1: float  # seconds per token when compute-bound

    def step(self, tokens: float) -> float:
        return math.hypot(self.c0, self.c1 * max(tokens, 1.0))


def fit_step_cost(points: Sequence[tuple[float, float]], prior_ratio: float = DEFAULT_COST_RATIO) -> StepCost | None:
    """Least squares of squared step duration on squared tokens per step (`t^2 = c0^2 + c1^2 n^2`); the
    prior ratio fills in a history that spans one regime only."""
    points = [(n, t) for n, t in points if n > 0 and t > 0]
    if not points:
        return None
    ns = [n for n, _ in points]
    if len(points) >= 3 and max(ns) >= 2.0 * min(ns):
        xs, ys = [n * n for n in ns], [t * t for _, t in points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
        intercept = mean_y - slope * mean_x
        if slope > 0 and intercept > 0:
            return StepCost(math.sqrt(intercept), math.sqrt(slope))
        if slope > 0:  # compute-bound at every observed size: the floor lies below the smallest step
            c1 = math.sqrt(sum(y / x for x, y in zip(xs, ys)) / len(xs))
            return StepCost(min(c1 * min(ns), min(t for _, t in points)) * 0.5, c1)
    # one regime only: scale the prior through the mean point
    n = sum(ns) / len(ns)
    t = sum(t for _, t in points) / len(points)
    c0 = t / math.hypot(1.0, prior_ratio * n)
    return StepCost(c0, c0 * prior_ratio)


def expected_accepted(per_pos: Sequence[float], k: int) -> float:
    """E[accepted tokens | a draft of k]; positions beyond those measured decay geometrically."""
    if k <= 0:
        return 0.0
    known = [max(0.0, min(1.0, a)) for a in per_pos]
    if not known:
        known = list(PRIOR_ACCEPTANCE)
    while len(known) < k:
        last = known[-1]
        ratio = known[-1] / known[-2] if len(known) >= 2 and known[-2] > 0 else 0.7
        known.append(last * min(ratio, 0.9))
    return sum(known[:k])


@dataclass(frozen=True)
class Prediction:
    config: TunedConfig
    batch: float  # sequences per step
    throughput: float  # output tokens/s
    tpot_s: float  # mean time per output token
    step_s: float
    waiting: float  # requests left waiting for a slot


@dataclass(frozen=True)
class LoadModel:
    """Everything about the current load the model needs: demand, acceptance, proposal share, prefill."""

    demand: float  # requests in the system
    per_pos: tuple[float, ...]  # P(position i accepted | draft)
    proposal_share: float  # share of sequence-steps that carried a draft when k > 0
    prefill_per_output: float  # prompt tokens computed per output token (prefill work scales with output)
    cost: StepCost

    def predict(self, config: TunedConfig) -> Prediction:
        k = config.num_speculative_tokens
        batch = max(1.0, min(self.demand, float(config.max_num_seqs)))
        p = self.proposal_share if k > 0 else 0.0
        per_seq = 1.0 + p * expected_accepted(self.per_pos, k)
        tokens = batch * (1.0 + p * k) + batch * per_seq * self.prefill_per_output
        step = self.cost.step(tokens)
        return Prediction(config, batch, batch * per_seq / step, step / per_seq, step,
                          max(0.0, self.demand - config.max_num_seqs))


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
