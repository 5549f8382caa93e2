"""Autoscaling in the simulator: the tuner's real replica policy drives the simulated fleet, a new replica
takes requests only after its start-up delay, and a fleet at zero replicas starts one from the router's
queue."""

from __future__ import annotations

import pytest
from helpers import cpu_like_profile
from specfleet.operator import load_inference_service
from specfleet.sim.fleet import SimFleet
from specfleet.sim.report import summarize
from specfleet.sim.workload import Lengths, SimRequest, Synthetic

# the CPU-like step cost; a new replica ready 8 s after it is started
PROFILE = cpu_like_profile(num_kv_blocks=1024, startup_s=8.0)


def autoscaled(min_replicas: int = 1, replicas: int = 1, queue_timeout: int = 0):
    return load_inference_service(
        {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "a"},
            "spec": {
                "model": {"source": "bundled://smollm2-135m-instruct", "maxModelLen": 2048},
                "batching": {"maxNumSeqs": 8, "maxNumBatchedTokens": 512},
                "replicas": replicas,
                "resources": {"gpus": 0},
                "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 200},
                "routing": {"queueTimeoutSeconds": queue_timeout},
                "autotune": {
                    "enabled": True,
                    "intervalSeconds": 5,
                    "bounds": {"maxNumSeqs": [8, 8], "maxNumBatchedTokens": [512, 512]},
                },
                "autoscaling": {
                    "enabled": True,
                    "minReplicas": min_replicas,
                    "maxReplicas": 2,
                    "scaleDownStabilizationSeconds": 30,
                    "cooldownSeconds": 10,
                },
            },
        }
    )


def test_rising_load_scales_one_to_two_and_back_after_the_startup_delay():
    # light (1 req/s), then 8 req/s (about 20 requests in the system against 8 seats per replica), light again
    load = Synthetic(
        rates=((0.0, 1.0), (60.0, 8.0), (120.0, 1.0)),
        duration_s=240,
        prompt=Lengths("fixed", 40, 40),
        output=Lengths("fixed", 60, 60),
        seed=3,
    )
    fleet = SimFleet(autoscaled(), PROFILE)
    run = fleet.run(list(load.requests()))
    changes = [(d["kind"], d["replicas"], d["t"]) for d in run.replica_decisions]
    assert [c[:2] for c in changes] == [("scale-up", 2), ("scale-down", 1)], run.replica_decisions
    up, down = changes[0][2], changes[1][2]
    assert 60 <= up < 120 and down > 120
    # the new replica is routable only `startup_s` after the decision: nothing reaches it before
    second = [r for r in run.records if r.engine == 1]
    assert second and min(r.engine_arrival_s for r in second) >= up + PROFILE.startup_s
    ready = [t for t in run.timeline if t.ready == 2]
    assert ready and min(t.t for t in ready) >= up + PROFILE.startup_s
    assert run.max_replicas == 2 and run.unfinished == 0 and run.rejected == 0
    # cost counts the second pod from its start (start-up included) to its stop, not the whole run
    assert run.duration_s < run.replica_seconds < 2 * run.duration_s
    assert fleet.stopped_s[1] == pytest.approx(down, abs=5.0)  # drained within a few seconds
    summary = summarize(run, PROFILE, {})
    assert summary["max_replicas"] == 2 and len(summary["replica_changes"]) == 2


def test_no_replica_then_the_router_queue_starts_one():
    reqs = [SimRequest(10.0 + 0.5 * i, 30, 20) for i in range(6)]
    run = SimFleet(autoscaled(min_replicas=0, replicas=0, queue_timeout=60), PROFILE).run(reqs)
    assert run.replicas == 0 and run.replica_decisions[0]["kind"] == "scale-up"
    assert run.replica_decisions[0]["t"] == pytest.approx(10.0)  # at the first queued request, not a tick
    assert len(run.records) == 6 and run.rejected == 0
    first = min(run.records, key=lambda r: r.index)
    assert first.first_token_s - first.arrival_s >= PROFILE.startup_s  # the cold start is in its TTFT
    # without a queue timeout the router answers 503 at once: nothing is served, nothing hangs (and the
    # service never wakes, which is why admission refuses minReplicas 0 without one: spec.SCALE_TO_ZERO)
    zero = autoscaled(min_replicas=0, replicas=0, queue_timeout=60)
    unqueued = zero.spec.routing.model_copy(update={"queue_timeout_seconds": 0})
    isvc = zero.model_copy(update={"spec": zero.spec.model_copy(update={"routing": unqueued})})
    cold = SimFleet(isvc, PROFILE).run(reqs)
    assert cold.rejected == 6 and not cold.records


def test_startup_delay_refuses_nonsense():
    with pytest.raises(ValueError, match="startup_s"):
        SimFleet(autoscaled(), PROFILE, startup_s=-1.0)
    with pytest.raises(ValueError, match="startup_s"):
        PROFILE.with_(startup_s=float("nan"))
    with pytest.raises(ValueError, match="needs the tuner"):
        SimFleet(autoscaled(), PROFILE, tune=False, autoscale=True)


def test_fast_mode_equals_exact_mode_under_the_tuner_and_the_autoscaler():
    load = Synthetic(
        rates=((0.0, 1.0), (60.0, 8.0), (120.0, 1.0)),
        duration_s=240,
        prompt=Lengths("uniform", 20, 200),
        output=Lengths("uniform", 10, 120),
        seed=3,
    )
    reqs = list(load.requests())
    exact = SimFleet(autoscaled(), PROFILE).run(reqs)
    fleet = SimFleet(autoscaled(), PROFILE, fast=True)
    fast = fleet.run(reqs)
    assert sum(e.fast_runs for e in fleet.engines) > 100
    assert fast.steps == exact.steps
    assert fast.replica_decisions == exact.replica_decisions and len(exact.replica_decisions) == 2
    assert fast.decisions == exact.decisions
    key = lambda r: r.index  # noqa: E731
    for a, b in zip(sorted(exact.records, key=key), sorted(fast.records, key=key), strict=True):
        assert (a.engine, a.output_tokens, a.preemptions) == (b.engine, b.output_tokens, b.preemptions)
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-9)
