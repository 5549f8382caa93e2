"""The goodput model's step-cost fit and its predictions, against known rooflines."""

from __future__ import annotations

import math
import random

import pytest
from specfleet.tuner.policy.model import LoadModel, StepCost, fit_step_cost, shadow_steps
from specfleet.tuner.policy.params import ModelParams
from specfleet.tuner.types import TunedConfig


def roofline(c0: float, c1: float, decode: float, prefill: float) -> float:
    return math.hypot(c0, c1 * decode) + c1 * prefill


@pytest.mark.parametrize("c0, c1", [(0.018, 0.003), (0.010, 0.0001), (0.050, 0.01)])
def test_fit_recovers_the_roofline_across_regimes(c0: float, c1: float) -> None:
    rng = random.Random(0)
    points = []
    for decode in (1, 2, 4, 8, 16, 32, 64, 128):
        for prefill in (0.0, 5.0):
            points.append((decode, prefill, roofline(c0, c1, decode, prefill) * (1 + rng.gauss(0, 0.03))))
    cost = fit_step_cost(points)
    assert cost is not None
    assert cost.c0 == pytest.approx(c0, rel=0.15) and cost.c1 == pytest.approx(c1, rel=0.3)
    if c1 * 128 > 2 * c0:  # the points reach past the knee: the corner's shape shows
        assert cost.shape == 2.0


# Step times on the 2-core AMD host (2026-12-02; the bundled model at fp32, chat through the API, closed
# loops at k=0 and concurrency 1 to 32): (decode tokens per step, prefill tokens per step, seconds).
AMD_PLAIN = (
    (1.0, 0.09, 0.0195),
    (1.98, 0.15, 0.0210),
    (3.96, 0.33, 0.0258),
    (7.93, 0.7, 0.0372),
    (15.8, 1.2, 0.0640),
    (30.7, 4.8, 0.117),
)
# ... and verification steps at concurrency 2 (drafts of k=2 and k=4, n-gram on chat)
AMD_VERIFY = ((3.97, 0.21, 0.0265), (5.6, 0.23, 0.0288))


def test_fit_takes_the_shape_of_the_corner() -> None:
    """A CPU's floor already costs per token (the AMD host's curve: 1.5); the hypotenuse (2) is recovered
    from itself; a GPU-like step, flat for a hundred tokens and then compute-bound, takes the sharp corner (3).
    On the CPU the fit of the plain windows prices the verification steps it never saw within 5 %, where
    the hypotenuse's best fit underprices a batch of 2's draft of 4 (the search's long drafts there, which
    probation reverted: docs/decisions/001-step-cost-model.md)."""
    from .plant import GPU_LIKE

    cpu = fit_step_cost(list(AMD_PLAIN))
    assert cpu is not None and cpu.shape == 1.5
    for decode, prefill, seconds in AMD_PLAIN + AMD_VERIFY:
        assert cpu.step(decode, prefill) == pytest.approx(seconds, rel=0.05), decode
    base = AMD_PLAIN[1]
    for decode, prefill, seconds in AMD_VERIFY:  # as the model uses it: a ratio to the config in force
        measured = seconds / base[2]
        assert cpu.step(decode, prefill) / cpu.step(*base[:2]) == pytest.approx(measured, rel=0.05)
    gpu = [(n, 0.0, GPU_LIKE.seconds(n)) for n in (1, 8, 32, 64, 128, 256, 384, 512)]
    fitted = fit_step_cost(gpu)
    assert fitted is not None and fitted.shape == 3.0
    assert fitted.knee == pytest.approx(200, rel=0.25)


def test_shadow_acceptance_is_read_as_runs_that_verification_covers_in_steps() -> None:
    """The AMD host (2026-12-02), bench tune's fleet (drafts of up to 6): shadow drafts at k=0 per lookup,
    against the tokens per sequence-step verification then measured. Chat at concurrency 2 (position 0 at
    0.27 shadow, 0.33 verified at k=2): read per step (`1 + p E_k`) the shadow figures underprice k=2 and
    k=4 by 4-6 %; as runs they are within 5 %. Grounded prompts at concurrency 1: runs that match the
    whole draft go on, and k=4 measured 10 % more tokens per step than k=3; cut at the draft's length the
    runs would call it 2 %, and the model took k=3."""
    chat, chat_share = (0.27, 0.16, 0.10, 0.08, 0.07, 0.06), 0.47
    measured = {2: 1.275, 4: 1.335}  # emitted / (steps x batch) over the static windows
    for k, tokens in measured.items():
        per_step, drafted = shadow_steps(chat, chat_share, k)
        assert per_step == pytest.approx(tokens, rel=0.05), k
        assert 1.0 + chat_share * sum(chat[:k]) < 0.97 * tokens  # the per-step reading underprices it
        assert chat_share < drafted < 1.0  # inside a run every step carries a draft
    grounded, grounded_share = (0.81, 0.75, 0.70, 0.60, 0.56, 0.55), 0.8
    k3, k4 = (shadow_steps(grounded, grounded_share, k)[0] for k in (3, 4))
    assert k3 == pytest.approx(2.81, rel=0.05) and k4 / k3 >= 3.10 / 2.81  # measured: 2.81 and 3.10
    # longer drafts never emit less per step
    for traffic, share in ((chat, chat_share), (grounded, grounded_share)):
        steps = [shadow_steps(traffic, share, k)[0] for k in range(1, 7)]
        assert steps == sorted(steps)
    # a model on shadow acceptance predicts with it; on verified acceptance, per step as before
    cost = StepCost(0.018, 0.003)
    runs = LoadModel(2.0, chat, chat_share, 0.0, cost, shadow=True).predict(TunedConfig(2, 32, 1024))
    steps_read = LoadModel(2.0, chat, chat_share, 0.0, cost).predict(TunedConfig(2, 32, 1024))
    assert runs.throughput > steps_read.throughput


def test_one_regime_uses_the_prior_ratio() -> None:
    cost = fit_step_cost([(1.0, 0.0, 0.02), (1.1, 0.0, 0.021), (1.0, 0.0, 0.019)])
    assert cost is not None and cost.c1 / cost.c0 == pytest.approx(ModelParams().prior_cost_ratio)
    assert cost.shape == 2.0
    assert cost.step(1.05) == pytest.approx(0.02, rel=0.05)
    assert fit_step_cost([]) is None


def test_verification_is_cheap_below_the_knee_and_dear_above_it() -> None:
    """The point of the roofline: 4 more tokens cost little at batch 1 and a lot at batch 32."""
    cost = StepCost(0.018, 0.003)
    assert cost.step(5) / cost.step(1) < 1.3
    assert cost.step(32 * 5) / cost.step(32) > 4


def test_prediction_prefers_speculation_at_low_load_and_not_at_high_load() -> None:
    per_pos = (0.7, 0.55, 0.45, 0.35)
    cost = StepCost(0.018, 0.003)
    low = LoadModel(demand=1.0, per_pos=per_pos, proposal_share=0.9, prefill_per_output=2.0, cost=cost)
    high = LoadModel(demand=32.0, per_pos=per_pos, proposal_share=0.9, prefill_per_output=0.5, cost=cost)
    off, on = TunedConfig(0, 32, 1024), TunedConfig(4, 32, 1024)
    assert low.predict(on).throughput > 1.5 * low.predict(off).throughput
    assert high.predict(on).throughput < high.predict(off).throughput


def _fitted(table) -> StepCost:
    """The step cost the policy's memory fits from windows of a plant running on `table`, loads 1..32."""
    from specfleet.tuner.policy.memory import Memory

    from .plant import Plant

    params = ModelParams()
    memory = Memory(params)
    config = TunedConfig(num_speculative_tokens=0, max_num_seqs=64, max_num_batched_tokens=2048)
    for i, demand in enumerate((1, 2, 4, 8, 16, 32)):
        memory.learn(Plant(demand=demand, steps=table).observe(30.0 * i, config))
    cost = fit_step_cost(list(memory.plain_cost_points), params)
    assert cost is not None
    return cost


def test_fit_follows_a_quantized_engines_lower_floor() -> None:
    """A gguf engine streams a fifth of float32's weight bytes and runs integer dot products: its one-token
    step is 0.28x float32's (measured, docs/results/2026-12-01-bench-quant-stepcost.md). Fitted from the
    windows a plant on each step table reports (loads 1..32, prefill riding along), the gguf engine's c0 falls
    at least as far and its knee moves from ~5 tokens to about one: speculation's verification tokens cost
    compute sooner on it. The smooth roofline fits the lowered table less well at one token (the table keeps
    float32's kinked slope on a lower floor), so that point's tolerance is wider; the model is used as a ratio
    (docs/tuner.md)."""
    from .plant import CPU_2CORES, CPU_2CORES_GGUF

    fp32, gguf = _fitted(CPU_2CORES), _fitted(CPU_2CORES_GGUF)
    floor_ratio = CPU_2CORES_GGUF.seconds(1) / CPU_2CORES.seconds(1)
    assert gguf.c0 / fp32.c0 <= floor_ratio
    assert fp32.knee == pytest.approx(5.0, rel=0.2) and gguf.knee <= 1.5
    for cost, table in ((fp32, CPU_2CORES), (gguf, CPU_2CORES_GGUF)):
        assert cost.step(1) == pytest.approx(table.seconds(1), rel=0.45)
        for tokens in (8, 32):
            assert cost.step(tokens) == pytest.approx(table.seconds(tokens), rel=0.2), tokens
