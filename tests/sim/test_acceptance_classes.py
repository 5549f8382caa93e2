"""Speculation per request: the engine's classes of acceptance, and the simulator drawing one per request.

The engine side is fed real `Sequence`s and the scheduler's own output types, stepped by hand as the engine
would (tokens appended, a sequence finished); the simulator side runs the real `SimFleet`.
"""

from __future__ import annotations

import json
import statistics

import pytest
from specfleet.engine.sampling_params import SamplingParams
from specfleet.engine.scheduler import ScheduledSeq, SchedulerOutput
from specfleet.engine.sequence import Sequence, Status
from specfleet.engine.spec_decode.request_classes import CLASSES, RequestClasses, class_of
from specfleet.operator import load_inference_service
from specfleet.sim.fleet import SimFleet
from specfleet.sim.profile import AcceptanceClass, Profile, acceptance_classes
from specfleet.sim.workload import SimRequest


def _seq(seq_id: int) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, [1, 2, 3, 4], 4, SamplingParams(max_tokens=16))


def _step(classes: RequestClasses, work: list[tuple[Sequence, int, int]]) -> None:
    """One step: each (sequence, proposals verified, tokens it gained); a prompt's step is (seq, 0, 1) on
    a sequence with no output yet."""
    sched = SchedulerOutput(
        [ScheduledSeq(seq, spec + 1 if seq.num_output_tokens else 4, spec, True) for seq, spec, _ in work]
    )
    for seq, _, gained in work:
        seq.token_ids.extend([7] * gained)
    classes.observe(sched, [(seq, gained) for seq, _, gained in work])


def test_the_engine_counts_each_finished_request_in_the_class_of_its_acceptance():
    classes = RequestClasses()
    copy, free, lone, aborted = _seq(0), _seq(1), _seq(2), _seq(3)
    _step(classes, [(copy, 0, 1), (free, 0, 1), (lone, 0, 1), (aborted, 0, 1)])  # the prompts: no decode step
    _step(classes, [(copy, 4, 5), (free, 2, 1), (lone, 0, 1), (aborted, 3, 4)])
    _step(classes, [(copy, 3, 3), (free, 0, 1), (lone, 0, 1)])  # copy: 2 of 3 accepted
    for seq, reason in ((copy, "length"), (free, "stop"), (lone, "length"), (aborted, "abort")):
        seq.status, seq.finish_reason = Status.FINISHED, reason
    _step(classes, [])
    by_class = {c: counts for c, counts in enumerate(classes.classes) if counts.requests}
    # copy accepted 6 of 7 draft tokens (class 1 + 8), free 0 of 2 (class 1), lone verified none (class 0),
    # the aborted request is not counted
    assert sorted(by_class) == [0, 1, 9]
    assert (by_class[9].decode_steps, by_class[9].drafts, by_class[9].draft_tokens) == (2, 2, 7)
    assert by_class[9].accepted_per_pos == [2, 2, 1, 1]
    assert (by_class[1].decode_steps, by_class[1].drafts, by_class[1].accepted_per_pos) == (2, 1, [0, 0])
    assert (by_class[0].decode_steps, by_class[0].drafts) == (2, 0)
    assert not classes._running  # nothing held for an ended sequence


def test_class_of_puts_all_accepted_in_the_last_class_and_no_draft_in_class_zero():
    from specfleet.engine.spec_decode.request_classes import RequestCounts

    assert class_of(RequestCounts(draft_tokens=0)) == 0
    assert class_of(RequestCounts(draft_tokens=8, accepted_tokens=8)) == CLASSES
    assert class_of(RequestCounts(draft_tokens=8, accepted_tokens=0)) == 1


def test_profile_classes_from_the_engines_counts_round_trip_and_old_files_load(tmp_path):
    classes = acceptance_classes(
        [(0, 0, 0, 0, []), (2, 20, 4, 8, [1, 0]), (3, 10, 10, 40, [10, 10, 9, 9])], 4
    )
    assert len(classes) == 2  # the empty class left out
    first = classes[0]
    assert (first.requests, first.share, first.accepted_per_pos) == (2.0, 0.2, (0.25, 0.0))
    q = first.proposal_continue  # 2 draft tokens a draft at k = 4
    assert sum(q**i for i in range(4)) == pytest.approx(2.0)
    assert classes[1].share == 1.0 and classes[1].accepted_per_pos == (1.0, 1.0, 0.9, 0.9)
    assert classes[1].proposal_continue == pytest.approx(1.0)
    profile = Profile("p", "measured", False, ((1, 0.05),), acceptance_classes=classes)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    old = profile.to_json()
    del old["acceptance_classes"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Profile.load(tmp_path / "old.json").acceptance_classes == ()
    with pytest.raises(ValueError, match="share"):
        AcceptanceClass(1.0, 1.5, ())
    with pytest.raises(ValueError, match="requests"):
        AcceptanceClass(0.0, 0.5, ())


ISVC = load_inference_service(
    {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "spec"},
        "spec": {
            "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 2048},
            "batching": {"maxNumSeqs": 16, "maxNumBatchedTokens": 512},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 4},
            "resources": {"gpus": 0},
        },
    }
)
BASE = Profile("p", "measured", False, ((1, 0.04), (64, 0.5)), prefill_s_per_token=0.001)
# one class that drafts every step and accepts every token, one that never drafts: 5 decode steps of 33
# tokens against 32
TWO = (AcceptanceClass(1.0, 1.0, (1.0, 1.0, 1.0, 1.0)), AcceptanceClass(1.0, 0.0, ()))


def _tpots(profile: Profile, **kwargs) -> list[float]:
    requests = [SimRequest(i * 2.0, 32, 33) for i in range(40)]  # one at a time: the step is the same
    run = SimFleet(ISVC, profile, seed=3, **kwargs).run(requests)
    return [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in run.records]


def test_each_simulated_request_speculates_by_the_class_it_drew():
    tpots = _tpots(BASE.with_(acceptance_classes=TWO))
    fast = [t for t in tpots if t < 0.02]
    slow = [t for t in tpots if t > 0.035]
    # every request is wholly one class or the other, about half each
    assert len(fast) + len(slow) == len(tpots)
    assert 10 <= len(fast) <= 30, sorted(tpots)
    # one distribution for all (the same mean acceptance) puts every request in between (or a little above
    # the never-drafting class: a request whose drafts mostly failed paid their verification)
    mixed = _tpots(BASE.with_(proposal_share=0.5, accepted_per_pos=(0.5, 0.5, 0.5, 0.5)))
    assert all(0.01 < t < 0.045 for t in mixed) and statistics.pstdev(mixed) < statistics.pstdev(tpots)


def test_an_acceptance_given_for_the_run_stands_for_every_request():
    tpots = _tpots(BASE.with_(acceptance_classes=TWO), accepted_per_pos=(1.0, 1.0, 1.0, 1.0))
    assert max(tpots) < 0.02  # the profile's share 1 and the given acceptance: every request fast


def test_the_classes_reach_bench_sim_through_the_servers_metrics():
    """The engine's per-class counters through `ServerMetrics` and the Prometheus text, read back by bench
    sim into the classes the profile takes: the same as from the counters directly."""
    from prometheus_client import generate_latest
    from specfleet.engine.server.metrics import ServerMetrics
    from specfleet.engine.spec_decode.request_classes import RequestCounts
    from specfleet.engine.stats import EngineStats
    from specfleet.sim.acceptance import classes_from_metrics

    counts = [RequestCounts() for _ in range(CLASSES + 1)]
    counts[0] = RequestCounts(1, 9, 0, 0, 0, [])
    counts[10] = RequestCounts(2, 12, 10, 36, 34, [10, 9, 8, 7])
    stats = EngineStats(request_classes=counts)
    metrics = ServerMetrics("m")
    metrics.observe_step(stats, True)
    earlier = generate_latest(metrics.registry).decode()
    counts[3].add(RequestCounts(1, 20, 4, 10, 3, [2, 1, 0, 0]))  # a third class, then a second step
    metrics.observe_step(stats, True)
    text = generate_latest(metrics.registry).decode()
    # what the second step added alone (bench sim: the trace's requests, not the overhead phases' before it)
    since = classes_from_metrics([text], 4, [earlier])
    assert since == (AcceptanceClass(1.0, 0.2, (0.5, 0.25, 0.0, 0.0), since[0].proposal_continue),)
    want = acceptance_classes(
        [(c.requests, c.decode_steps, c.drafts, c.draft_tokens, c.accepted_per_pos) for c in counts], 4
    )
    assert len(want) == 3
    # two engines' texts sum
    assert classes_from_metrics([text], 4) == want
    doubled = classes_from_metrics([text, text], 4)
    assert [c.requests for c in doubled] == [2 * c.requests for c in want]
    assert [c.accepted_per_pos for c in doubled] == [c.accepted_per_pos for c in want]
    assert classes_from_metrics([generate_latest(ServerMetrics("m").registry).decode()], 4) == ()


def test_simulate_takes_the_classes_from_saved_metrics_and_refuses_a_text_without(tmp_path):
    from prometheus_client import generate_latest
    from specfleet.engine.server.metrics import ServerMetrics
    from specfleet.engine.spec_decode.request_classes import RequestCounts
    from specfleet.engine.stats import EngineStats
    from specfleet.sim.cli import with_classes_from

    counts = [RequestCounts() for _ in range(CLASSES + 1)]
    counts[10] = RequestCounts(3, 12, 12, 48, 48, [12, 12, 12, 12])
    metrics = ServerMetrics("m")
    metrics.observe_step(EngineStats(request_classes=counts), True)
    (tmp_path / "a.txt").write_bytes(generate_latest(metrics.registry))
    (tmp_path / "empty.txt").write_bytes(generate_latest(ServerMetrics("m").registry))
    got = with_classes_from(BASE, f"{tmp_path / 'a.txt'},{tmp_path / 'empty.txt'}", 4)
    assert got.acceptance_classes == (AcceptanceClass(3.0, 1.0, (1.0, 1.0, 1.0, 1.0), 1.0),)
    with pytest.raises(ValueError, match="acceptance-from .*no specfleet_spec_decode_class_"):
        with_classes_from(BASE, str(tmp_path / "empty.txt"), 4)
