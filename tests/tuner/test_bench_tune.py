"""`specfleet bench tune`'s bookkeeping: which static configs share a measurement, and the summary's ratios."""

from __future__ import annotations

import pytest
from specfleet.bench.tune import equivalent_groups, mean_passes, summarize
from specfleet.tuner.types import TunedConfig

GRID = {f"k={k},seqs={s}": TunedConfig(k, s, 1024) for k in (0, 2) for s in (8, 32)}


def test_configs_whose_max_num_seqs_never_binds_share_a_measurement() -> None:
    assert sorted(equivalent_groups(GRID, 2)) == [
        ["k=0,seqs=8", "k=0,seqs=32"],
        ["k=2,seqs=8", "k=2,seqs=32"],
    ]
    assert len(equivalent_groups(GRID, 32)) == 4  # at 32 in flight, 8 sequences per step binds
    # a different step budget is a different behaviour even when max_num_seqs does not bind
    assert len(equivalent_groups({"a": TunedConfig(2, 8, 512), "b": TunedConfig(2, 32, 1024)}, 1)) == 2


def p(goodput: float, attainment: float = 1.0) -> dict[str, float]:
    return {
        "goodput": goodput,
        "throughput": goodput,
        "requests": 10,
        "slo_attainment": attainment,
        "seconds": 60,
    }


def test_summary_compares_the_tuner_with_the_best_static_overall_and_per_phase() -> None:
    static = {"k=0": {"a": p(40), "b": p(400)}, "k=4": {"a": p(100), "b": p(150)}}
    tuner = {"a": p(95), "b": p(380, 0.9)}
    out = summarize([static], [tuner], {"pass 1: a": 2, "pass 1: b": 1}, [])
    assert out["best_static_config"] == "k=0" and out["best_static_goodput"] == 220
    assert out["goodput_ratio"] == pytest.approx(237.5 / 220, abs=1e-3)
    assert out["per_phase_ratio"] == {"a": 0.95, "b": 0.95} and out["per_phase_ratio_min"] == 0.95
    assert out["per_phase_best_static"] == {"a": "k=4", "b": "k=0"}
    assert out["slo_attainment"] == pytest.approx(0.95) and out["changes_per_transition_max"] == 2


def test_the_hindsight_best_is_picked_on_one_pass_and_valued_on_the_other() -> None:
    """Two configs equally good, each lucky on one pass: the plain maximum (90) overstates what either
    delivers; picked on one pass and valued on the other, the best static config is worth 80."""
    first = {"k=2": {"a": p(90)}, "k=4": {"a": p(70)}}
    second = {"k=2": {"a": p(70)}, "k=4": {"a": p(90)}}
    out = summarize([first, second], [{"a": p(76)}], {}, [])
    assert out["best_static_goodput"] == 70 and out["best_static_config"] == "k=2 / k=4"
    assert out["per_phase_ratio"] == {"a": pytest.approx(76 / 70, abs=1e-3)}
    assert out["per_phase_ratio_min_vs_max"] == pytest.approx(
        76 / 80, abs=1e-3
    )  # against the averaged passes
    # a config best on both passes is valued at its mean
    out = summarize([first, {"k=2": {"a": p(80)}, "k=4": {"a": p(60)}}], [{"a": p(76)}], {}, [])
    assert out["best_static_config"] == "k=2" and out["best_static_goodput"] == 85


def test_static_passes_are_averaged_per_config_and_phase() -> None:
    before = {"k=0": {"a": p(100)}, "k=2": {"a": p(60)}}
    after = {"k=0": {"a": p(80)}, "k=2": {"a": p(70)}}
    out = mean_passes([before, after])
    assert out["k=0"]["a"]["goodput"] == 90 and out["k=0"]["a"]["requests"] == 20
    assert out["k=2"]["a"]["goodput"] == 65 and out["k=2"]["a"]["seconds"] == 60


def test_tuner_passes_are_averaged_and_every_transition_counts() -> None:
    """Two tuner passes (before and after the static grid) measure the same thing twice: their mean per
    phase is compared, and the worst transition of either pass sets the change count."""
    static = {"k=0": {"a": p(100)}}
    out = summarize([static], [{"a": p(110)}, {"a": p(90, 0.8)}], {"pass 1: a": 1, "pass 2: a": 2}, [])
    assert out["tuner_passes"] == 2 and out["tuner_goodput"] == 100 and out["per_phase_ratio_min"] == 1.0
    assert out["slo_attainment"] == pytest.approx(0.9) and out["changes_per_transition_max"] == 2
    assert [t["a"]["goodput"] for t in out["tuner_by_pass"]] == [110, 90]
