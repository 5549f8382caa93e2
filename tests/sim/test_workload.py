"""Workloads: traces round-trip and refuse bad lines by field; synthetic arrivals follow their rate."""

from __future__ import annotations

import pytest
from specfleet.sim.workload import (
    Lengths,
    SimRequest,
    Synthetic,
    load_trace,
    parse_lengths,
    parse_rates,
    save_trace,
)


def test_trace_round_trips_and_sorts(tmp_path):
    reqs = [SimRequest(1.5, 30, 10), SimRequest(0.25, 40, 5, prefix_group=2, prefix_tokens=16)]
    save_trace(reqs, tmp_path / "t.jsonl")
    back = load_trace(tmp_path / "t.jsonl")
    assert back == sorted(reqs, key=lambda r: r.arrival_s)


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 2}', "arrival_s"),
        ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 2}', "prompt_tokens"),
        (
            '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2, "prefix_group": 1, "prefix_tokens": 9}',
            "prefix_tokens",
        ),
        ('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2, "colour": 1}', "colour"),
        ("not json", "2"),
    ],
)
def test_bad_trace_line_names_line_and_field(tmp_path, line, field):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2") as info:
        load_trace(path)
    assert field in str(info.value)


def test_poisson_count_and_rate_schedule():
    w = Synthetic(rates=((0.0, 5.0), (100.0, 0.0), (150.0, 20.0)), duration_s=200.0, seed=3)
    reqs = list(w.requests())
    first = [r for r in reqs if r.arrival_s < 100]
    assert 500 - 3 * 500**0.5 < len(first) < 500 + 3 * 500**0.5
    assert not [r for r in reqs if 100 <= r.arrival_s < 150]
    last = [r for r in reqs if r.arrival_s >= 150]
    assert 1000 - 3 * 1000**0.5 < len(last) < 1000 + 3 * 1000**0.5


def test_gamma_burstier_than_poisson():
    def cv_of(cv: float) -> float:
        times = [
            r.arrival_s for r in Synthetic(rates=((0.0, 10.0),), duration_s=500, cv=cv, seed=1).requests()
        ]
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert 0.9 < cv_of(1.0) < 1.1
    assert cv_of(3.0) > 2.0


def test_prefix_groups_share_exactly_their_prefix():
    a = SimRequest(0, 40, 4, prefix_group=1, prefix_tokens=32)
    b = SimRequest(0, 50, 4, prefix_group=1, prefix_tokens=32)
    c = SimRequest(0, 40, 4, prefix_group=2, prefix_tokens=32)
    pa, pb, pc = a.prompt_ids(0), b.prompt_ids(1), c.prompt_ids(2)
    assert pa[:32] == pb[:32] and pa[32] != pb[32]
    assert not set(pa) & set(pc)
    assert len(pa) == 40 and len(pb) == 50


def test_lengths_and_rates_parse_or_say_how():
    assert parse_lengths("uniform:3-9") == Lengths("uniform", 3, 9)
    assert parse_rates("0:2,60:8") == ((0.0, 2.0), (60.0, 8.0))
    with pytest.raises(ValueError, match="uniform:LOW-HIGH"):
        parse_lengths("uniform:9-3")
    with pytest.raises(ValueError, match="FROM_S:RATE"):
        parse_rates("fast")


def test_bench_serve_records_a_trace_the_simulator_reads(tmp_path):
    from specfleet.bench.serve import CONTEXT, BenchRequest, Result, write_trace

    mix = [BenchRequest(CONTEXT * 2 + "Q1", 8), BenchRequest("Q2", 8), BenchRequest("Q3", 8)]
    results = [
        Result(ok=True, output_tokens=8, prompt_tokens=40, sent_s=100.5),
        Result(ok=True, output_tokens=6, prompt_tokens=5, sent_s=100.0),
        Result(ok=False, sent_s=100.7),
    ]
    write_trace(results, mix, str(tmp_path / "t.jsonl"))
    trace = load_trace(tmp_path / "t.jsonl")
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_group) for r in trace] == [
        (0.0, 5, 6, None),
        (0.5, 40, 8, 2),
    ]


def test_bench_sim_prompts_keep_the_traces_prefix_structure_in_real_token_ids():
    from specfleet.bench.sim import real_prompt

    a = SimRequest(0, 300, 4, prefix_group=1, prefix_tokens=256)
    b = SimRequest(0, 290, 4, prefix_group=1, prefix_tokens=256)
    c = SimRequest(0, 300, 4, prefix_group=2, prefix_tokens=256)
    pa, pb, pc = real_prompt(a, 0, False), real_prompt(b, 1, False), real_prompt(c, 2, False)
    assert pa[:256] == pb[:256] != pc[:256]
    assert pa[256:270] != pb[256:270]
    assert (len(pa), len(pb)) == (300, 290) and all(100 <= t < 49000 for t in pa + pc)
    copy = real_prompt(SimRequest(0, 48, 4), 3, True)
    assert copy[:12] == copy[12:24]  # the pattern an n-gram proposer can copy from
