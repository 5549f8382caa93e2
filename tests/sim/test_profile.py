"""Profiles: the fit recovers a known step cost; roofline estimates follow the datasheet arithmetic."""

from __future__ import annotations

import pytest
from specfleet.sim.profile import Profile, StepPoint, fit_error, fitted_profile
from specfleet.sim.roofline import HARDWARE, MODELS, roofline_profile


def test_fit_recovers_knee_and_per_token_costs(tmp_path):
    truth = Profile(
        "t",
        "measured",
        False,
        ((1, 0.018), (8, 0.030), (32, 0.105), (64, 0.197)),
        prefill_s_per_token=0.003,
        context_s_per_token=2e-6,
    )
    points = [
        StepPoint(d, p, c, 0, truth.step_s(d, p, c))
        for d in (1, 2, 4, 8, 16, 32, 64)
        for p in (0, 128)
        for c in (64, 2048)
    ]
    got = fitted_profile("fit", points)
    assert fit_error(got)["max_pct"] < 1.0
    assert got.prefill_s_per_token == pytest.approx(0.003, rel=0.02)
    assert got.context_s_per_token == pytest.approx(2e-6, rel=0.05)
    assert got.decode_s(1) == pytest.approx(0.018, rel=0.02)
    got.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == got


def test_profile_refuses_nonsense():
    with pytest.raises(ValueError, match="increasing"):
        Profile("x", "measured", False, ((4, 0.1), (2, 0.2)))
    with pytest.raises(ValueError, match="kind"):
        Profile("x", "guess", False, ((1, 0.1),))


def test_roofline_h100_llama3_8b_is_labelled_and_memory_bound_at_batch_one():
    p = roofline_profile("h100-sxm", "llama3-8b")
    assert p.estimate and p.kind == "roofline" and "ESTIMATE" in p.notes
    weights = MODELS["llama3-8b"].params * 2
    floor = weights / (HARDWARE["h100-sxm"].bandwidth_bytes_s * 0.8) + 0.004
    assert p.decode_s(1) == pytest.approx(floor, rel=1e-6)  # ~10 ms
    assert p.decode_s(512) > p.decode_s(1)  # past the knee compute takes over
    assert p.num_kv_blocks > 10_000  # ~55 GB of KV at 128 KiB per token
    with pytest.raises(ValueError, match="raise tp"):
        roofline_profile("l4", "llama3-70b")
    with pytest.raises(ValueError, match="unknown hardware"):
        roofline_profile("tpu-v9", "llama3-8b")
    assert roofline_profile("h100-sxm", "llama3-70b", tp=4).decode_s(1) < roofline_profile(
        "h100-sxm", "llama3-70b", tp=2
    ).decode_s(1)


def test_default_profile_is_the_bundled_models_cpu_costs():
    from specfleet.sim.cli import load_profile

    p = load_profile(None)
    assert p.kind == "measured" and not p.estimate
    assert p.decode_s(1) == pytest.approx(0.018) and p.decode_s(64) == pytest.approx(0.197)
    assert load_profile("roofline:h100-sxm:llama3-8b:2").hardware == "2 x h100-sxm"


def test_a_roofline_profile_covers_the_tp_degrees_its_model_splits_and_fits_a_measured_one_its_own(tmp_path):
    from specfleet.sim.cli import load_profile
    from specfleet.sim.roofline import at_tp, covers_tp, tp_degrees

    assert tp_degrees(roofline_profile("h100-sxm", "llama3-8b")) == (1, 2, 4, 8)
    assert tp_degrees(roofline_profile("h100-sxm", "llama3-70b", tp=2)) == (2, 4, 8)  # 141 GB of weights
    assert tp_degrees(roofline_profile("h100-sxm", "qwen2.5-7b")) == (1, 2, 4)  # 28 heads: 8 does not divide
    with pytest.raises(ValueError, match="28 attention heads"):
        roofline_profile("h100-sxm", "qwen2.5-7b", tp=8)
    measured = load_profile(None)
    assert tp_degrees(measured) == (1,) and "covers tp=1 only" in (covers_tp(measured, 2) or "")
    # derived again from the inputs it keeps (also through its JSON file), with what it carries beyond
    base = roofline_profile("l4", "llama3-8b").with_(accepted_per_pos=(0.7, 0.5), request_overhead_s=0.01)
    base.save(tmp_path / "l4.json")
    two = at_tp(Profile.load(tmp_path / "l4.json"), 2)
    assert two.tp == 2 and two.estimate and two.kind == "roofline" and "ESTIMATE" in two.notes
    assert two.decode_s(1) == pytest.approx(roofline_profile("l4", "llama3-8b", tp=2).decode_s(1))
    assert two.decode_s(1) < base.decode_s(1) and two.num_kv_blocks > 2 * base.num_kv_blocks
    assert (two.accepted_per_pos, two.request_overhead_s) == ((0.7, 0.5), 0.01)


def test_profile_and_plan_offer_the_engines_speculative_methods():
    from specfleet.engine.config import SPECULATIVE_METHODS
    from specfleet.sim import measure, plan

    for parser in (measure.build_parser(), plan.build_parser()):
        (method,) = [a for a in parser._actions if a.dest == "method"]
        assert method.choices is SPECULATIVE_METHODS  # the one list, not a copy that can drift


def test_fit_takes_verification_steps_apart_from_the_decode_curve():
    """Verification steps (k = 2 and 4) between the plain steps' batches set the cost per verifying
    sequence, not knots of their own (a free knot at 8 decode tokens once took 182 ms from one k = 4 step
    where plain steps of 4 and 16 sequences took 70 and 154 ms)."""
    truth = Profile(
        "t", "measured", False, ((1, 0.046), (64, 0.487)), prefill_s_per_token=0.005, verify_s_per_seq=0.012
    )
    plain = [StepPoint(b, 0, 32 * b, 0, truth.core_s(b, 0, 32 * b)) for b in (1, 4, 16, 32)]
    verifying = [
        StepPoint(b + d, 0, 32 * b, d, truth.core_s(b + d, 0, 32 * b, d, v), v)
        for b, v, d in ((4, 1, 2), (4, 3, 10), (16, 4, 12), (32, 8, 26))
    ]
    prefill = [StepPoint(0, n, 0, 0, truth.core_s(0, n)) for n in (32, 320)]
    got = fitted_profile("fit", plain + verifying + prefill)
    assert [k for k, _ in got.knots] == [1, 4, 16, 32, 58]
    assert fit_error(got)["max_pct"] < 1.0
    assert got.verify_s_per_seq == pytest.approx(0.012, rel=0.05)
    assert got.decode_s(8) == pytest.approx(truth.decode_s(8), rel=0.02)


def test_proposal_continue_gives_the_measured_draft_length():
    from specfleet.sim.profile import proposal_continue

    q = proposal_continue(3.04, 4)
    assert sum(q**i for i in range(4)) == pytest.approx(3.04, rel=1e-6)
    assert proposal_continue(4.0, 4) == proposal_continue(1.0, 1) == 1.0
    with pytest.raises(ValueError, match="proposal_continue"):
        Profile("x", "measured", False, ((1, 0.1),), proposal_continue=0.0)


def test_roofline_moe_reads_the_experts_its_tokens_reach_and_multiplies_only_active_parameters():
    """Qwen3-30B-A3B: one token reads the shared weights and 8 of 128 experts; a batch of 512 reaches
    nearly all of them; prefill costs 2 FLOPs per active parameter, not per stored one."""
    m = MODELS["qwen3-30b-a3b"]
    assert m.weight_bytes_read(1) == pytest.approx(m.active_params * m.bytes_per_param, rel=1e-6)
    assert m.weight_bytes_read(512) == pytest.approx(m.params * m.bytes_per_param, rel=1e-3)
    p = roofline_profile("h100-sxm", "qwen3-30b-a3b")
    floor = m.active_params * 2 / (HARDWARE["h100-sxm"].bandwidth_bytes_s * 0.8) + 0.004
    assert p.decode_s(1) == pytest.approx(floor, rel=1e-6)  # ~6.5 ms: a 3B model's, not a 30B one's
    assert p.prefill_s_per_token == pytest.approx(2 * m.active_params / (HARDWARE["h100-sxm"].flops * 0.6))
