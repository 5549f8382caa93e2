"""The goodput model: what a config would do at the load observed now, from what was measured.

Step cost: one engine step costs `t(n) = c0 + c1 * n` seconds for `n` tokens in the forward pass (c0 is
the weights' memory traffic and per-op overhead, c1 the per-token compute). A decode step with batch `B`
and `k` speculative tokens processes about `B * (1 + p * k)` tokens, where `p` is the share of
sequence-steps that carried a proposal (n-gram finds no match on some), and emits `B * (1 + p * E_k)`
tokens with `E_k = sum_{i<k} a_i`, `a_i` = P(position i accepted) from the per-position counters.
Prefill rides along at the observed ratio of prompt tokens to output tokens.

Speculation pays while the tokens it adds are cheap next to c0 (memory-bound decode, small batch)
and costs once `c1 * B * k` dominates (large batch). The model is only used as a ratio against
the config in force, so its absolute error cancels; each change is then confirmed by measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .histogram import fraction_below
from .types import SLO, Observation, TunedConfig

# Prior for c1/c0 when the observed points do not span enough tokens per step to fit a slope: measured
# for the bundled 135M model on a 2-core CPU (about 65 ms + 2.2 ms per token). GPUs have a smaller ratio,
# which only makes the prior conservative about speculation there.
DEFAULT_COST_RATIO = 1 / 30
# Prior per-position acceptance before any draft was verified (n-gram on chat text, measured elsewhere).
PRIOR_ACCEPTANCE = (0.5, 0.35, 0.25, 0.18, 0.13, 0.1, 0.07, 0.05)


@dataclass(frozen=True)
class StepCost:
    c0: float  # seconds per step, independent of tokens
    c1: float  # seconds per token

    def step(self, tokens: float) -> float:
        return self.c0 + self.c1 * max(tokens, 1.0)


def fit_step_cost(points: Sequence[tuple[float, float]], prior_ratio: float = DEFAULT_COST_RATIO) -> StepCost | None:
    """Least squares of step duration on tokens per step; the prior ratio fills in a flat or short history."""
    points = [(n, t) for n, t in points if n > 0 and t > 0]
    if not points:
        return None
    ns = [n for n, _ in points]
    if len(points) >= 3 and max(ns) >= 2.0 * min(ns):
        mean_n = sum(ns) / len(ns)
        mean_t = sum(t for _, t in points) / len(points)
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
        intercept = mean_t - slope * mean_n
        if slope > 0 and intercept > 0:
            return StepCost(intercept, slope)
        if slope > 0:  # steeper than linear from the origin: tokens are what costs; keep a small floor
            low_t = min(t for n, t in points if n == min(ns))
            c0 = 0.1 * low_t
            return StepCost(c0, max((mean_t - c0) / mean_n, 1e-9))
    # one regime only: scale the prior through the mean point
    n = sum(ns) / len(ns)
    t = sum(t for _, t in points) / len(points)
    c0 = t / (1.0 + prior_ratio * n)
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
