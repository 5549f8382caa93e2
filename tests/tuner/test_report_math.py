"""Histogram arithmetic against PromQL's rules, and what one interval writes to status and Events."""

from __future__ import annotations

import math

import pytest
from specfleet.tuner.actuator import ApplyResult
from specfleet.tuner.histogram import fraction_below, quantile, subtract, to_cdf
from specfleet.tuner.loop import Tick
from specfleet.tuner.report import event_for, status_patch
from specfleet.tuner.snapshot import PER_POSITION, build_observation, observe_pairs, parse_metrics
from specfleet.tuner.types import Decision, Observation, TunedConfig

BUCKETS = [(0.1, 10.0), (0.2, 50.0), (0.5, 90.0), (math.inf, 100.0)]


def test_quantile_interpolates_like_promql() -> None:
    assert quantile(0.5, BUCKETS) == pytest.approx(0.1 + 0.1 * (50 - 10) / 40)
    assert quantile(0.95, BUCKETS) == pytest.approx(0.5)  # falls in +Inf: the highest finite bound
    assert quantile(0.05, BUCKETS) == pytest.approx(0.05)
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_cdf_and_deltas() -> None:
    cdf = to_cdf(BUCKETS)
    assert fraction_below(cdf, 0.2) == pytest.approx(0.5)
    assert fraction_below(cdf, 0.35) == pytest.approx(0.7)
    assert subtract([(0.1, 5.0), (math.inf, 8.0)], [(0.1, 2.0), (math.inf, 3.0)]) == [
        (0.1, 3.0),
        (math.inf, 5.0),
    ]
    assert subtract([(0.1, 1.0), (math.inf, 1.0)], [(0.1, 2.0), (math.inf, 3.0)]) == [
        (0.1, 1.0),
        (math.inf, 1.0),
    ]


def _tick(kind: str, config: TunedConfig | None, failed: dict[str, str] | None = None) -> Tick:
    obs = Observation(
        time=1.0,
        config=TunedConfig(0, 16, 512),
        tpot_p95_s=0.05,
        ttft_p95_s=0.3,
        request_rate=2.0,
        draft_token_rate=10.0,
        accepted_rate=6.0,
    )
    applied = ApplyResult(config or TunedConfig(0, 16, 512), failed=failed or {})
    return Tick(
        Decision(1.0, config, f"{kind} because of reasons", kind, observed_goodput=12.5),
        obs,
        applied,
        guard=7,
    )


def test_positions_past_the_k_in_force_are_left_out() -> None:
    """Counters of positions 2 and 3 linger from an earlier k=4 but were not drafted under k=2: reading
    them as never accepted would tell the tuner that a longer draft gains nothing."""
    rates = {
        "spec_decode_drafts": 10.0,
        "spec_decode_draft_tokens": 20.0,
        "spec_decode_accepted_tokens": 15.0,
    }
    per_pos = {PER_POSITION[0]: {0: 8.0, 1: 7.0, 2: 0.0, 3: 0.0}}

    def positions(config: TunedConfig | None) -> tuple[float, ...]:
        obs = build_observation(1.0, rates, per_pos, {}, {}, {}, 3.0, 1.0, 0.1, config, 1)
        assert obs.in_system_now == 4.0
        return obs.accepted_per_pos

    assert positions(TunedConfig(2, 8, 512)) == pytest.approx((0.8, 0.7))
    assert positions(None) == pytest.approx((0.8, 0.7, 0.0, 0.0))  # pods disagree: every position seen


def test_shadow_drafts_read_as_acceptance_per_position_and_a_share_found() -> None:
    """k = 0: the engine's shadow counters, through its /metrics text and two scrapes, give P(first i + 1
    tokens came out) for every position it scored (0 included) and the share of lookups that found one."""

    def text(lookups: float, drafts: float, accepted: list[float]) -> str:
        lines = [
            f'specfleet_spec_decode_shadow_lookups_total{{model_name="m"}} {lookups}',
            f'specfleet_spec_decode_shadow_drafts_total{{model_name="m"}} {drafts}',
        ]
        lines += [
            f'specfleet_spec_decode_shadow_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {a}'
            for i, a in enumerate(accepted)
        ]
        return "\n".join(lines) + "\n"

    before = parse_metrics(text(10, 5, [2, 1, 0, 0]), 0.0)
    after = parse_metrics(text(50, 25, [12, 6, 2, 0]), 2.0)
    obs = observe_pairs([(before, after)], 2.0)
    assert obs.shadow_share == pytest.approx(0.5)
    assert obs.shadow_accepted_per_pos == pytest.approx((0.5, 0.25, 0.1, 0.0))
    assert obs.accepted_per_pos == () and obs.acceptance_rate is None  # nothing verified


def test_status_patch_writes_tuning_and_only_the_tuners_condition() -> None:
    config = TunedConfig(2, 16, 512)
    previous = {
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": ""}]
    }
    patch = status_patch(_tick("change", config), config, previous, 3, "2026-01-01T00:00:00Z")
    tuning = patch["tuning"]
    assert (tuning["numSpeculativeTokens"], tuning["maxNumSeqs"], tuning["maxNumBatchedTokens"]) == (
        2,
        16,
        512,
    )
    assert tuning["speculativeDisableByBatchSize"] == 7
    assert tuning["observed"] == {
        "acceptanceRate": 0.6,
        "ttftP95Ms": 300.0,
        "tpotP95Ms": 50.0,
        "goodput": 12.5,
        "requestRate": 2.0,
    }
    assert tuning["lastDecisionTime"] == "2026-01-01T00:00:00Z" and "reasons" in tuning["reason"]
    types = {c["type"]: c for c in patch["conditions"]}
    assert set(types) == {
        "Tuned"
    }  # the reconcile's Ready is its own (server-side apply keeps it; tests/operator)
    assert types["Tuned"]["status"] == "True" and types["Tuned"]["reason"] == "ConfigChanged"
    assert event_for(_tick("change", config).decision) == ("Normal", "Tuned", "change because of reasons")


def test_missing_data_and_apply_failures_show_in_the_condition() -> None:
    held = status_patch(_tick("missing", None), TunedConfig(2, 16, 512), {}, 1, "t")
    assert {c["type"]: c["reason"] for c in held["conditions"]}["Tuned"] == "MetricsUnavailable"
    assert event_for(_tick("missing", None).decision) is None
    failed = status_patch(_tick("hold", None, {"http://10.0.0.1:8000": "ConnectError"}), None, {}, 1, "t")
    cond = {c["type"]: c for c in failed["conditions"]}["Tuned"]
    assert cond["status"] == "False" and cond["reason"] == "ApplyFailed" and "10.0.0.1" in cond["message"]
    assert event_for(_tick("revert", TunedConfig(0, 16, 512)).decision)[:2] == ("Warning", "TuningReverted")
