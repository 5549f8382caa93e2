"""`specfleet bench route --phases eviction`, its pure parts (no engine starts): the workload's sizing and
what it refuses, the transcript's prefix property, the figures and the goals they are held to."""

from __future__ import annotations

import json
import math

import pytest
from specfleet.bench import route
from specfleet.bench.route_decisions import Decision, DecisionLog
from specfleet.bench.route_eviction import (
    EvictionRun,
    Mode,
    eviction_figures,
    plan,
    round_modes,
    size_workload,
    skewed_conversations,
    transcript,
)
from specfleet.bench.route_workload import Turn


def _sizing(**overrides: float) -> dict[str, float]:
    # 440-token system prompts (27 full blocks), conversations of at most 560 tokens (35 blocks)
    base = {
        "kv_blocks": 128,
        "block_size": 16,
        "system_tokens": 440,
        "longest_tokens": 560,
        "concurrency": 2,
        "pressure": 2.0,
        "max_model_len": 2048,
    }
    return {**base, **overrides}


def test_the_tenants_system_prompts_fill_the_pressure_times_the_fleets_cache() -> None:
    sizing = size_workload(**_sizing())
    assert (sizing.system_blocks, sizing.fleet_blocks) == (27, 256)
    assert sizing.tenants == math.ceil(2.0 * 256 / 27) == 19
    assert sizing.working_set_blocks == 19 * 27 >= 2.0 * 256 > 18 * 27  # the fewest tenants that do
    # two conversations of 35 blocks on one engine at most (the load cap: ceil(1.25 * 2 / 2) = 2)
    assert sizing.running_blocks_per_engine == 70


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pressure": 1.0}, r"--eviction-pressure=1.0 must be > 1"),
        ({"system_tokens": 15}, r"15-token system prompt, under one 16-token block"),
        ({"kv_blocks": 0}, r"--eviction-kv-blocks=0 must be >= 1"),
        ({"kv_blocks": 127}, r"--eviction-kv-blocks=127 holds fewer .* maxModelLen=2048: give it >= 128"),
        ({"concurrency": 0}, r"--eviction-concurrency=0 must be >= 1"),
        # 4 in flight: up to ceil(1.25 * 4 / 2) = 3 conversations of 35 blocks = 105 > 0.75 * 128
        ({"concurrency": 4}, r"--eviction-kv-blocks=128: the 3 conversations .* 105 blocks.* >= 140 blocks"),
    ],
)
def test_a_workload_without_pressure_or_room_is_refused_naming_the_flag(
    overrides: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        size_workload(**_sizing(**overrides))


def test_the_defaults_put_the_bundled_models_fleet_under_pressure() -> None:
    """The bench's own flags, measured with SmolLM2's tokenizer: accepted, and the system prompts alone
    exceed twice the fleet's cache."""
    import yaml

    args = route.build_parser().parse_args(["--phases", "eviction"])
    args.isvc = yaml.safe_load(open(args.file).read())
    sizing = plan(args)
    assert sizing.fleet_blocks == 2 * args.eviction_kv_blocks
    assert 430 // 16 <= sizing.system_blocks <= 480 // 16  # 14 rules of ~30 tokens
    assert sizing.working_set_blocks >= args.eviction_pressure * sizing.fleet_blocks
    assert sizing.running_blocks_per_engine <= 0.75 * args.eviction_kv_blocks
    # enough in flight for the load cap to bind on two engines (route_decisions: with two it never does)
    assert args.eviction_concurrency >= 3


def test_each_turns_prompt_extends_the_last_ones() -> None:
    first = transcript("SYSTEM", [], "Q1")
    second = transcript("SYSTEM", [("Q1", "A1")], "Q2")
    assert first == "SYSTEM\nUser: Q1\nAssistant:"
    assert second.startswith(first) and second.endswith("\nUser: Q2\nAssistant:")


def _run(
    ttfts: list[float], hits: float, queries: float, prompt: float, matched: float, mode: Mode = "events"
) -> EvictionRun:
    turns = [Turn(t, t + 1, 4, True) for t in ttfts] + [Turn(0.0, 5.0, 0, False)]  # one failed
    keys = [(f"conv-{i}", 0) for i in range(len(turns))]
    return EvictionRun(mode, turns, keys, 10.0, hits, queries, prompt, matched, 16)


def test_the_figures_are_the_issues_two_and_whether_they_meet_its_goals() -> None:
    events = _run([0.1, 0.2, 0.3], hits=880, queries=1000, prompt=100, matched=90)
    estimate = _run([0.3, 0.4, 0.5], hits=500, queries=1000, prompt=100, matched=95, mode="estimate")
    out = eviction_figures([events], [estimate])
    assert out["index_vs_engine_hit_rate_gap"] == round(0.90 / 0.88 - 1, 3) == 0.023
    assert out["ttft_p50_ratio_events_vs_estimate"] == 0.5  # 200 ms over 400 ms, the failed turn left out
    assert out["goals_met"] == {"hit_rate_gap": True, "ttft_p50_ratio": True}
    assert out["estimate_index_vs_engine_hit_rate_gap"] == 0.9  # 0.95 predicted where the engines hit 0.5
    assert out["events"]["index_vs_engine_hit_tokens"] == round(90 * 16 / 880, 3)
    assert (out["events"]["requests"], out["events"]["failed"]) == (4, 1)
    assert out["estimate"]["ttft_p50_ms"] == 400.0


def test_each_modes_figures_are_the_medians_of_its_rounds() -> None:
    events = [
        _run([0.1], hits=800, queries=1000, prompt=100, matched=80),  # gap 0
        _run([0.3], hits=500, queries=1000, prompt=100, matched=60),  # gap +0.2, the slow round
        _run([0.2], hits=800, queries=1000, prompt=100, matched=84),  # gap +0.05
    ]
    estimate = [_run([t], 500, 1000, 100, 90, "estimate") for t in (0.4, 0.1)]
    out = eviction_figures(events, estimate)
    assert out["events"]["ttft_p50_ms"] == 200.0 and out["estimate"]["ttft_p50_ms"] == 250.0
    assert out["ttft_p50_ratio_events_vs_estimate"] == 0.8
    assert out["index_vs_engine_hit_rate_gap"] == 0.05  # the median round's, not one round's
    assert out["goals_met"] == {"hit_rate_gap": True, "ttft_p50_ratio": True}


def test_the_ttft_where_the_picks_differ_joins_each_turn_to_its_decision() -> None:
    run = _run([0.1, 0.2, 0.9], hits=1, queries=1, prompt=1, matched=1)
    # conv-0 and conv-2 parted (conv-2's turn took 900 ms); the failed conv-3 is left out
    run.log = DecisionLog(
        [
            Decision("conv-0", "prefix", 28, 27, 0, 27, cap_bound=True, differ=True),
            Decision("conv-1", "prefix", 28, 27, 0, 27, cap_bound=True, differ=False),
            Decision("conv-2", "ring", 28, 0, 0, 0, cap_bound=True, differ=True),
            Decision("conv-3", "ring", 28, 0, 0, 0, cap_bound=True, differ=True),
        ]
    )
    per_decision = eviction_figures([run], [run])["per_decision"]["events"]
    assert per_decision["ttft_p50_ms_where_picks_differ"] == 500.0  # 100 and 900 ms
    assert (per_decision["decisions"], per_decision["picks_differ"], per_decision["cap_bound"]) == (4, 3, 4)
    assert per_decision["stale_at_pick"] == 2 and per_decision["held_longer_elsewhere"] == 2


def test_goals_missed_and_figures_without_a_denominator_are_said_so() -> None:
    over = eviction_figures(
        [_run([0.5], hits=500, queries=1000, prompt=100, matched=60)],  # 0.6 against 0.5: +20%
        [_run([0.5], hits=500, queries=1000, prompt=100, matched=60)],
    )
    assert over["index_vs_engine_hit_rate_gap"] == 0.2
    assert over["goals_met"] == {"hit_rate_gap": False, "ttft_p50_ratio": False}  # ratio 1.0
    empty = eviction_figures([_run([], 0, 0, 0, 0)], [_run([], 0, 0, 0, 0)])
    assert empty["index_vs_engine_hit_rate_gap"] is None
    assert empty["ttft_p50_ratio_events_vs_estimate"] is None
    assert empty["goals_met"] == {"hit_rate_gap": False, "ttft_p50_ratio": False}
    json.dumps(empty, allow_nan=False)  # strict JSON: None, never NaN


def test_the_rounds_alternate_the_modes_abba() -> None:
    assert round_modes(4) == ["events", "estimate", "estimate", "events"]
    assert round_modes(6) == ["events", "estimate", "estimate", "events", "events", "estimate"]
    with pytest.raises(ValueError, match=r"--eviction-rounds=1 must be >= 2"):
        round_modes(1)


def test_the_tenants_popularity_follows_the_skew() -> None:
    def top_share(skew: float) -> float:
        convs = skewed_conversations(22, 2000, 1, skew, seed=0)
        return sum(t == 0 for t, _ in convs) / len(convs)

    # Zipf 1 over 22 tenants: the first 1 / H(22) = 0.27 of the conversations; uniform: 1/22
    assert abs(top_share(1.0) - 0.27) < 0.03 and abs(top_share(0.0) - 1 / 22) < 0.015
    convs = skewed_conversations(22, 64, 3, 1.0, seed=0)
    assert convs == skewed_conversations(22, 64, 3, 1.0, seed=0)  # deterministic: the same every round
    assert len(convs) == 64 and all(len(questions) == 3 for _, questions in convs)


def test_the_cli_refuses_an_unknown_phase_or_a_workload_without_pressure_before_any_engine(capsys) -> None:
    assert route.main(["--phases", "policies,evictions"]) == 2
    assert "choose from policies, eviction" in capsys.readouterr().out
    for flags, message in [
        (["--eviction-pressure", "0.5"], "--eviction-pressure=0.5 must be > 1"),
        (["--eviction-rounds", "1"], "--eviction-rounds=1 must be >= 2"),
        (["--eviction-skew", "-1"], "--eviction-skew=-1.0 must be >= 0"),
        (["--eviction-conversations", "0"], "--eviction-conversations=0 must be >= 1"),
        (["--eviction-turns", "0"], "--eviction-turns=0 must be >= 1"),
    ]:
        assert route.main(["--phases", "eviction", *flags]) == 2
        assert message in capsys.readouterr().out
