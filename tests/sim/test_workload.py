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


def test_bench_serve_records_a_trace_whose_shared_paragraphs_hit_the_simulators_prefix_cache(tmp_path):
    from specfleet.bench.serve import CONTEXT, BenchRequest, Result, write_trace
    from specfleet.operator import load_inference_service
    from specfleet.sim.fleet import SimFleet
    from specfleet.sim.profile import Profile

    # a server whose tokenizer makes a paragraph 40 tokens and a question 5; the usage is all bench sees
    mix = [BenchRequest(CONTEXT * n + f"Q{i}", 8) for i, n in enumerate((8, 0, 8, 2, 4))]
    mix.append(BenchRequest(CONTEXT * 2 + "Q4", 8))  # Q4 again, with 2 paragraphs less: 80 tokens less
    tokens = [40 * req.prompt.count(CONTEXT) + 5 for req in mix]
    results = [
        Result(ok=True, output_tokens=8, prompt_tokens=t, sent_s=100.0 + i) for i, t in enumerate(tokens)
    ]
    results[1] = Result(ok=False, sent_s=101.0)  # failed requests are left out
    write_trace(results, mix, str(tmp_path / "t.jsonl"))
    trace = load_trace(tmp_path / "t.jsonl")
    assert [(r.arrival_s, r.prompt_tokens, r.prefix_group, r.prefix_tokens) for r in trace] == [
        (0.0, 325, 0, 320),
        (2.0, 325, 0, 320),
        (3.0, 85, 0, 80),
        (4.0, 165, 0, 160),
        (5.0, 85, 0, 80),
    ]
    # replayed: each request reuses the full blocks of the paragraphs an earlier one left in the cache
    isvc = load_inference_service(
        {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "t"},
            "spec": {"model": {"source": "bundled://x"}, "resources": {"gpus": 0}},
        }
    )
    profile = Profile("p", "measured", False, ((1, 0.01),), prefill_s_per_token=1e-4)
    run = SimFleet(isvc, profile).run(trace)
    cached = [r.cached_tokens for r in sorted(run.records, key=lambda r: r.index)]
    assert cached == [0, 320, 80, 160, 80]  # 20, 5, 10 and 5 blocks of 16 tokens


def test_bench_serve_estimates_a_paragraphs_tokens_without_repeated_questions():
    from specfleet.bench.serve import CONTEXT, BenchRequest, Result, context_tokens

    mix = [BenchRequest(CONTEXT * n + q, 8) for n, q in ((1, "Alpha?"), (4, "Beta?"))]
    done = [(Result(ok=True, prompt_tokens=len(req.prompt) // 4), req) for req in mix]
    assert context_tokens(done) == pytest.approx(len(CONTEXT) / 4, rel=0.02)  # the run's tokens per char


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
