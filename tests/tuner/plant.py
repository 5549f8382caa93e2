"""A synthetic engine fleet for policy tests: a config and a load in, an `Observation` out.

Its step time comes from its own table of measured step times (`StepTable`), not from the policy's cost
model: the policy fits a smooth roofline to what the plant reports, so a test that passes shows the policy
working on a step cost shaped like the engine's, kinks included, not on its own model. On top, an optional
cost per drafted token that the policy's model does not know about (a draft model's own passes), and an
acceptance that can differ from what the policy assumes (that is the point of the revert tests). Its
latencies are spread uniformly around their mean, so that p95 and the CDFs are exact.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from dataclasses import dataclass, field

from specfleet.tuner.types import Observation, TunedConfig

BUCKETS = (
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)


@dataclass(frozen=True)
class StepTable:
    """Step time by tokens in the step's forward pass (every sequence's next token, its draft, and the
    prefill chunks riding along), interpolated linearly between the points and extended past the last
    at the slope of the last two (compute-bound there)."""

    points: tuple[tuple[float, float], ...]  # (tokens per step, milliseconds), tokens ascending

    def seconds(self, tokens: float) -> float:
        xs = [n for n, _ in self.points]
        i = min(max(bisect_right(xs, tokens), 1), len(xs) - 1)
        (n0, t0), (n1, t1) = self.points[i - 1], self.points[i]
        return max(t0 + (t1 - t0) * (max(tokens, 1.0) - n0) / (n1 - n0), self.points[0][1]) / 1000.0

    def with_compute(self, scale: float) -> StepTable:
        """The same step with the time above a one-token step scaled: a machine with `scale` times the
        compute per token and the same weights' traffic (the floor)."""
        floor = self.points[0][1]
        return StepTable(tuple((n, floor + (t - floor) * scale) for n, t in self.points))

    def with_floor(self, scale: float) -> StepTable:
        """The same step with its floor (the one-token step) scaled and the time above it kept: an engine
        that streams fewer weight bytes per step and computes the same per token."""
        floor = self.points[0][1]
        return StepTable(tuple((n, t - floor * (1.0 - scale)) for n, t in self.points))


# The bundled model (SmolLM2-135M, float32, native kernels) on the 2-core CPU, from the figures measured in
# the docs: 18 ms at 1 token, 30 ms at 8, 105 ms at 32, 197 ms at 64 (docs/decisions/001-step-cost-model.md)
# and a verification of k = 4 at concurrency 1 (5 tokens) at about 1.2x a one-token step
# (docs/decisions/013-native-cpu-linear.md). A fresh measurement on the shared 2-core machine was tried and
# read 4-5x these (load average 9 from other work), so the documented figures stand.
CPU_2CORES = StepTable(((1, 18.0), (5, 21.6), (8, 30.0), (32, 105.0), (64, 197.0)))

# The same machine running the bundled GGUF's Q4_1/Q8_0 weights as stored (`--quantization gguf`, int8
# activations): the one-token step at 0.28x float32's (the mean of two same-process A/B measurements on the
# shared machine, 0.30 and 0.255: docs/results/2026-12-01-bench-quant-stepcost.md), the time above the floor
# kept. The compute per token of the int8 dot products is lower than float32's too, but the batch points of
# those runs were too noisy (load average 12-15 on 2 cores) to say by how much, so the float32 slope stands
# in as an upper bound.
CPU_2CORES_GGUF = CPU_2CORES.with_floor(0.28)

# Hardware whose knee lies far above the CPU's (GPU-like: compute per token tiny next to the weights'
# traffic): synthetic, since no GPU step time is measured in the repository; flat at 20 ms for a few
# hundred tokens, then compute-bound.
GPU_LIKE = StepTable(((1, 20.0), (128, 21.0), (256, 27.0), (512, 52.0)))


def uniform_cdf(mean: float, spread: float = 0.25) -> list[tuple[float, float]]:
    low, high = mean * (1 - spread), mean * (1 + spread)
    return [(le, max(0.0, min(1.0, (le - low) / (high - low)))) for le in BUCKETS]


@dataclass
class Plant:
    demand: float = 1.0  # requests in the system (closed loop)
    per_pos: tuple[float, ...] = (0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55)
    proposal_share: float = 1.0
    steps: StepTable = field(default=CPU_2CORES)
    spec_overhead: float = 0.0  # extra seconds per drafted token the model does not know about
    prefill_tokens_per_request: float = 60.0
    output_tokens_per_request: float = 64.0
    noise: float = 0.0
    demand_now: float | None = None  # the gauges' count at the window's end, when the load just moved
    pods: int = 1  # engines the demand is spread over evenly; rates and counts are their sums
    shadow: bool = False  # with k = 0 the engines score n-gram lookups (engine/spec_decode/shadow.py)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _jitter(self, value: float) -> float:
        return value * (1.0 + self.rng.gauss(0.0, self.noise)) if self.noise else value

    def observe(
        self, t: float, config: TunedConfig | None, running_config: TunedConfig | None = None
    ) -> Observation:
        cfg = running_config or config
        assert cfg is not None
        k = cfg.num_speculative_tokens
        batch = max(1.0, min(self.demand / self.pods, cfg.max_num_seqs))  # per engine
        waiting = max(0.0, self.demand - self.pods * cfg.max_num_seqs)
        drafted = batch * self.proposal_share * k
        per_seq = 1.0 + self.proposal_share * sum(self.per_pos[:k])
        prefill_per_step = batch * per_seq * self.prefill_tokens_per_request / self.output_tokens_per_request
        step = self.steps.seconds(batch + drafted + prefill_per_step) + self.spec_overhead * drafted
        step_rate = self.pods / step  # summed over the engines, like every rate below
        gen_rate = batch * per_seq * step_rate
        prefill = prefill_per_step * step_rate
        tpot = step / per_seq
        ttft = step * 2 + waiting / (self.pods * batch) * step * self.output_tokens_per_request / per_seq
        drafts = batch * self.proposal_share * step_rate if k else 0.0
        # one lookup per sequence-step while none is being scored: a scored draft holds its sequence
        # for its accepted tokens and the one after
        lookups = (
            batch * step_rate / (1.0 + self.proposal_share * sum(self.per_pos))
            if self.shadow and not k
            else 0.0
        )
        return Observation(
            time=t,
            config=config,
            pods=self.pods,
            request_rate=self._jitter(gen_rate / self.output_tokens_per_request),
            generation_rate=self._jitter(gen_rate),
            prompt_rate=self._jitter(prefill),
            running=batch * self.pods,
            waiting=waiting,
            in_system_now=self.demand if self.demand_now is None else self.demand_now,
            kv_usage=0.2,
            ttft_p95_s=self._jitter(ttft * 1.225),  # p95 of the uniform spread: 1 + 0.25 * 0.9
            tpot_p95_s=self._jitter(tpot * 1.225),
            ttft_cdf=uniform_cdf(self._jitter(ttft)),
            tpot_cdf=uniform_cdf(self._jitter(tpot)),
            step_rate=step_rate,
            step_duration_s=self._jitter(step),
            batch_size=batch,
            draft_rate=drafts,
            draft_token_rate=drafts * k,
            accepted_rate=drafts * sum(self.per_pos[:k]),
            accepted_per_pos=tuple(self._jitter(a) for a in self.per_pos[:k]) if k else (),
            shadow_lookup_rate=lookups or None,
            shadow_draft_rate=lookups * self.proposal_share or None,
            shadow_accepted_per_pos=tuple(self._jitter(a) for a in self.per_pos) if lookups else (),
        )
