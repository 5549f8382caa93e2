"""The goodput model: what a config would do at the load observed now, from what was measured.

Step cost: one engine step over `n` tokens in the forward pass costs `t(n) = (c0^s + (c1 * n)^s)^(1/s)`
seconds, a smooth roofline: `c0` is the memory-bound floor (the weights' traffic and per-op overhead,
paid once per step however few tokens it has), `c1` the compute cost per token once the step is
compute-bound, and the shape `s` how sharp the corner between them is (2: the hypotenuse; larger, a
flatter floor and a sharper knee, as on a GPU; smaller, a floor on which every token already costs, as
on a CPU); the fit picks the shape with the ratio. Why this form, the prior and the shapes, with the
measurements that set them: see docs/decisions/001-step-cost-model.md. Prefill chunks are compute-bound
and add `c1` per prompt token on top.
A decode step with batch `B` and `k` speculative tokens processes about `B * (1 + p * k)` tokens, where
`p` is the share of sequence-steps that carried a proposal (n-gram finds no match on some), and emits
`B * (1 + p * E_k)` tokens with `E_k = sum_{i<k} a_i`, `a_i` = P(position i accepted) from the
per-position counters (from shadow drafts, which are scored per run rather than per step: `shadow_steps`).
Prefill rides along at the observed ratio of prompt tokens to output tokens.

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
from ..types import SLO, Cdf, Observation, TunedConfig
from .load import batch_per_engine, per_engine, step_tokens
from .params import ModelParams

DEFAULT = ModelParams()

# Ratios c1/c0 the fit tries, 1e-3 .. 1, twenty per decade: from a GPU's knee at a thousand tokens to a
# step that is compute-bound from its first token; ten per decade was too coarse (which side of the dead
# band a draft fell on depended on the grid): see docs/decisions/001-step-cost-model.md.
RATIOS = tuple(10 ** (e / 20) for e in range(-60, 1))
# Shapes the fit tries (`s` above): 1.5 for a CPU's floor, where every token already costs, 2 the
# hypotenuse, 3 a GPU-like flat floor with a sharp knee. Not 1 (an affine step has no floor and
# overpriced verification at a batch of 2): see docs/decisions/001-step-cost-model.md.
SHAPES = (1.5, 2.0, 3.0)


@dataclass(frozen=True)
class StepCost:
    c0: float  # seconds per step when memory-bound: the floor
    c1: float  # seconds per token when compute-bound
    shape: float = 2.0  # how sharp the corner between the floor and the slope is (SHAPES)

    def step(self, decode_tokens: float, prefill_tokens: float = 0.0) -> float:
        """Decode and verification tokens ride on the floor; prefill chunks are compute-bound."""
        return _corner(self.c0, self.c1 * max(decode_tokens, 1.0), self.shape) + self.c1 * max(
            prefill_tokens, 0.0
        )

    @property
    def knee(self) -> float:
        """Tokens per step where the step turns compute-bound."""
        return self.c0 / self.c1


def fit_step_cost(
    points: Sequence[tuple[float, float, float]], params: ModelParams = DEFAULT
) -> StepCost | None:
    """Fit `c0`, `c1` and the shape to (decode tokens per step, prefill tokens per step, step seconds)
    points.

    For each shape and ratio `c1/c0` the scale is a closed-form least squares of relative error (so that
    20 ms and 200 ms steps weigh alike); the pair with the least error wins when the points span at
    least a factor of 2 in decode tokens and it fits clearly better than the prior, else the prior ratio
    at the hypotenuse's shape (`ModelParams.fit_*`).
    """
    pts = [(d, p, t) for d, p, t in points if d > 0 and t > 0]
    if not pts:
        return None

    def fit(ratio: float, shape: float) -> tuple[float, float]:
        q = [(_corner(1.0, ratio * max(d, 1.0), shape) + ratio * max(p, 0.0)) / t for d, p, t in pts]
        c0 = sum(q) / sum(x * x for x in q)
        return sum((c0 * x - 1.0) ** 2 for x in q), c0

    prior = (params.prior_cost_ratio, 2.0)
    ratio, shape = prior
    decode = [d for d, _, _ in pts]
    if len(pts) >= params.fit_min_points and max(decode) >= params.fit_min_span * min(decode):
        best = min(((r, s) for s in SHAPES for r in RATIOS), key=lambda rs: fit(*rs)[0])
        if fit(*best)[0] < params.fit_min_gain * fit(*prior)[0]:
            ratio, shape = best
    c0 = fit(ratio, shape)[1]
    return StepCost(c0, c0 * ratio, shape)


def _corner(floor: float, slope: float, shape: float) -> float:
    """The smooth maximum of the floor and the slope term: their `shape`-norm."""
    if shape == 2.0:
        return math.hypot(floor, slope)
    return float((floor**shape + slope**shape) ** (1.0 / shape))


def shadow_steps(
    per_pos: Sequence[float], share: float, k: int, params: ModelParams = DEFAULT
) -> tuple[float, float]:
    """(tokens emitted per sequence-step, share of sequence-steps carrying a draft) that speculation at
    `k` would have, from shadow drafts' acceptance: each shadow draft is scored up to its full length
    (`per_pos[i]` = P(its first i + 1 tokens came out) per lookup that found one, `share` of lookups), so
    one draft that matched `M` tokens is a run that verification at `k` covers in ceil((M + 1) / (k + 1))
    steps, a fresh lookup at each. Verified drafts' per-position acceptance counts each of those steps
    as a draft: it is per step, so shadow figures read per step as `1 + p E_k` underprice a draft. A run
    that matched the whole draft goes on for one more draft length, decaying as `expected_accepted`
    extrapolates positions (a copied passage runs on). The levels run a little high; the ranking, which
    the search uses, matches the measured one: see docs/decisions/002-shadow-drafts-as-runs.md."""
    at_least = [1.0, *(max(0.0, min(1.0, a)) for a in per_pos)]  # P(M >= m), m = 0 .. len(per_pos)
    ratio = params.decay_ratio
    if len(at_least) >= 3 and at_least[-2] > 0:
        ratio = at_least[-1] / at_least[-2]
    ratio = min(ratio, params.max_decay_ratio)
    for _ in range(len(per_pos)):
        at_least.append(at_least[-1] * ratio)
    at_least.append(0.0)
    tokens = steps = 0.0  # per lookup with a draft: M matched, one more; and the steps that takes
    for m in range(len(at_least) - 1):
        run = at_least[m] - at_least[m + 1]  # P(M = m)
        tokens += run * (m + 1)
        steps += run * math.ceil((m + 1) / (k + 1))
    per_lookup_steps = 1.0 - share + share * steps
    return (1.0 - share + share * tokens) / per_lookup_steps, share * steps / per_lookup_steps


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
    shadow: bool = False  # per_pos and proposal_share are shadow drafts' (per lookup), not verified ones'
    runnable_share: float = 1.0  # of the demand, what adapter slots admit (Observation.lora_runnable_share)

    def predict(self, config: TunedConfig) -> Prediction:
        k = config.num_speculative_tokens
        runnable = self.demand * self.runnable_share  # max_num_seqs above it adds no sequence to a step
        batch = max(1.0, batch_per_engine(runnable, self.engines, config.max_num_seqs))
        if k > 0 and self.shadow and self.per_pos:
            per_seq, p = shadow_steps(self.per_pos, self.proposal_share, k, self.params)
        else:
            p = self.proposal_share if k > 0 else 0.0
            per_seq = 1.0 + p * expected_accepted(self.per_pos, k, self.params)
        step = self.cost.step(step_tokens(batch, k, p), batch * per_seq * self.prefill_per_output)
        return Prediction(
            config,
            batch,
            batch * per_seq / step,
            step / per_seq,
            step,
            max(
                0.0,
                per_engine(self.demand, self.engines)
                - min(config.max_num_seqs, per_engine(runnable, self.engines)),
            ),
        )


def attainment(obs: Observation, slo: SLO, tpot_scale: float = 1.0, ttft_scale: float = 1.0) -> float | None:
    """Estimated share of requests meeting both targets, if latencies scaled by the given factors.

    Reads each target off the measured CDF at `target / scale` and assumes TTFT and TPOT independent.
    """
    return _both(obs.ttft_cdf, obs.tpot_cdf, slo, tpot_scale, ttft_scale)


def _both(
    ttft_cdf: Cdf, tpot_cdf: Cdf, slo: SLO, tpot_scale: float = 1.0, ttft_scale: float = 1.0
) -> float | None:
    tpot = fraction_below(tpot_cdf, slo.tpot_p95_s / tpot_scale)
    ttft = fraction_below(ttft_cdf, slo.ttft_p95_s / ttft_scale)
    if tpot is None and ttft is None:
        return None
    return (1.0 if tpot is None else tpot) * (1.0 if ttft is None else ttft)


def observed_goodput(obs: Observation, slo: SLO) -> float | None:
    """Output tokens/s of requests meeting the SLO (throughput times estimated attainment)."""
    share = attainment(obs, slo)
    if obs.generation_rate is None or share is None:
        return None
    return obs.generation_rate * share


@dataclass(frozen=True)
class AdapterGoodput:
    name: str
    goodput: float  # output tokens/s of the adapter's requests meeting the SLO
    attainment: float  # estimated share of its requests meeting both targets


def adapter_goodput(obs: Observation, slo: SLO) -> tuple[AdapterGoodput, ...]:
    """`observed_goodput` per LoRA adapter, from each adapter's own TTFT and TPOT histograms and output
    tokens (`Observation.lora_requests`): the service's SLO, read per adapter. An adapter whose requests
    the draft model serves worse (it runs without the adapter, so fewer drafts are accepted) shows here
    below the others at the same load."""
    seen = []
    for a in obs.lora_requests:
        share = _both(a.ttft_cdf, a.tpot_cdf, slo)
        if share is not None:
            seen.append(AdapterGoodput(a.name, a.generation_rate * share, share))
    return tuple(seen)
