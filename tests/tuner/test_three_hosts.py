"""Joint config and replica tuning is one sequence (`ServiceTuner.interval`, `from_zero`) in its three
hosts: the operator's timer (tuner/handlers.py `tune`, against the Kubernetes API double), the local
fleet (`LocalFleet.tick`) and the simulator (`SimFleet.run`). Each host keeps its own wiring (its tuner's
build, its actuator, its side of the `Scaler` port); only the metrics source is replaced, by one script
of observations that all three read at the same times. They must take the same config and replica
decisions, and each must act on them its own way: `status.autoscaling` in the API, `scale_to` in the
local fleet, simulated engines in the simulator.

The local fleet's `scale_to` starts engine processes (minutes of model loading here), so its test records
the counts it is asked for instead; everything around it (the tuner it builds, `tick`, its `scale`) runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import kopf
import pytest
from fake_kube import FakeKube  # tests/ is on sys.path (rootdir conftest)
from helpers import cpu_like_profile
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator import load_inference_service
from specfleet.operator.config import OperatorConfig
from specfleet.operator.kube import KubeClient
from specfleet.sim.fleet import SimFleet
from specfleet.sim.workload import Lengths, Synthetic
from specfleet.tuner import handlers
from specfleet.tuner.loop import ServiceTuner, Tick, params_from_spec, spec_config
from specfleet.tuner.policy import Policy
from specfleet.tuner.types import Observation, TunedConfig

from .cluster import AUTOTUNED_SPEC, ISVC, example_service, put_service
from .plant import Plant

NS = "team-j"
INTERVAL = 5.0  # AUTOTUNED_SPEC's autotune.intervalSeconds
INTERVALS = 12
# maxReplicas 3 so that the knob has room for a while; a 10 s cooldown so that it moves twice within
# the script; the HPA's immediate scale-up.
AUTOSCALING = {
    "enabled": True,
    "minReplicas": 1,
    "maxReplicas": 3,
    "scaleDownStabilizationSeconds": 60,
    "cooldownSeconds": 10,
}
SPEC: dict[str, Any] = {
    **AUTOTUNED_SPEC,
    "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 100},
    "autoscaling": AUTOSCALING,
}


def script() -> list[Observation]:
    """A load of 40 requests in the system on one engine at the spec's start config (k=3, 16 sequences):
    TPOT far over its target and requests waiting, the case where the config would cut the batch and the
    replica knob would add a replica. The same observations for every host, whatever they decide."""
    plant = Plant(demand=40.0)
    config = TunedConfig(3, 16, 512)
    return [plant.observe(i * INTERVAL, config) for i in range(INTERVALS)]


class ScriptSource:
    """The metrics source, replaced: the next observation of the script at the host's clock; past its end
    an observation that says so (every host then holds)."""

    def __init__(self, observations: list[Observation], clock: Callable[[], float]) -> None:
        self.observations, self.clock = list(observations), clock

    async def observe(self) -> Observation:
        if not self.observations:
            return Observation(time=self.clock(), config=None, error="the script ended")
        return replace(self.observations.pop(0), time=self.clock())

    async def close(self) -> None:
        pass


class Clock:
    """The operator's and the local fleet's clock, moved one interval at a time by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scripted(tuner: ServiceTuner, clock: Callable[[], float]) -> ServiceTuner:
    tuner.source = ScriptSource(script(), clock)
    tuner.clock = clock
    return tuner


Decisions = list[tuple[str, str | None, str, int]]


def decisions(ticks: list[Tick]) -> Decisions:
    """(config decision kind, the config it set, replica decision kind, replicas) per interval."""
    out: Decisions = []
    for tick in ticks[:INTERVALS]:
        assert tick.replicas is not None, "an interval without a replica decision: autoscaling is on"
        config = tick.decision.config.short() if tick.decision.config else None
        out.append((tick.decision.kind, config, tick.replicas.kind, tick.replicas.replicas))
    return out


def operator_host(fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch) -> tuple[Decisions, dict[str, Any]]:
    """The kopf timer's handler, called as kopf calls it once per tick; the clock moves one interval per
    call, so each call is an interval. Returns the decisions and the status it wrote."""
    doc = example_service("smollm2", **SPEC)
    put_service(fake_kube, NS, doc)
    clock = Clock()
    build = handlers._build

    async def build_scripted(*args: Any) -> ServiceTuner:
        return scripted(await build(*args), clock)

    ticks: list[Tick] = []
    status_patch = handlers.status_patch

    def keep(tick: Tick, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ticks.append(tick)
        return status_patch(tick, *args, **kwargs)

    monkeypatch.setattr(handlers, "_build", build_scripted)
    monkeypatch.setattr(handlers, "status_patch", keep)
    monkeypatch.setattr(kopf, "info", lambda *a, **k: None)  # Events need kopf's posting loop
    monkeypatch.setattr(kopf, "warn", lambda *a, **k: None)

    async def run() -> dict[str, Any]:
        client = KubeClient(fake_kube.url)
        monkeypatch.setattr(handlers, "kube_client", lambda memo: client)
        memo = kopf.Memo(config=OperatorConfig.from_env())  # no prometheusURL: the source is the script
        try:
            for i in range(INTERVALS):
                clock.t = i * INTERVAL
                body = fake_kube.get(*ISVC, NS, "smollm2") or {}
                await handlers.tune(
                    body=body,
                    meta=body["metadata"],
                    status=body.get("status") or {},
                    memo=memo,
                    logger=logging.getLogger("test"),
                )
            for tuner, _, _ in memo["tuners"].values():
                await tuner.close()
        finally:
            await client.close()
        return (fake_kube.get(*ISVC, NS, "smollm2") or {}).get("status") or {}

    status = asyncio.run(run())
    return decisions(ticks), status


class RecordingFleet(LocalFleet):
    """The local fleet with its tuner on the script and `scale_to` recorded instead of run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = Clock()
        self.scaled: list[int] = []

    def new_tuner(self) -> ServiceTuner:
        return scripted(super().new_tuner(), self.clock)

    async def scale_to(self, replicas: int) -> None:
        self.scaled.append(replicas)


def local_host() -> tuple[Decisions, list[int]]:
    isvc = load_inference_service(example_service("smollm2", **SPEC))

    async def run() -> tuple[Decisions, list[int]]:
        fleet = RecordingFleet(isvc, say=lambda line: None)
        fleet.tuner = fleet.new_tuner()
        try:
            for i in range(INTERVALS):
                fleet.clock.t = i * INTERVAL
                await fleet.tick()
        finally:
            await fleet.tuner.close()
        return decisions(fleet.ticks), fleet.scaled

    return asyncio.run(run())


# the CPU-like step cost of tests/sim/test_sim_autoscale.py: what the simulated engines run is not read by
# the script, only their count
PROFILE = cpu_like_profile(num_kv_blocks=1024, startup_s=8.0)


def sim_host() -> tuple[Decisions, SimFleet, int]:
    isvc = load_inference_service(example_service("smollm2", **SPEC))
    fleet = SimFleet(isvc, PROFILE, fast=True)
    assert fleet.tuner is not None
    scripted(fleet.tuner, lambda: fleet.now)
    # arrivals for longer than the script, so that the fleet runs every interval of it
    load = Synthetic(
        rates=((0.0, 2.0),),
        duration_s=INTERVALS * INTERVAL + 10,
        prompt=Lengths("fixed", 32, 32),
        output=Lengths("fixed", 16, 16),
        seed=1,
    )
    run = fleet.run(list(load.requests()))
    return decisions(run.ticks), fleet, run.max_replicas


def config_policy_alone() -> list[tuple[str, str | None]]:
    """The script's config decisions without the replica knob beside the policy."""
    spec = load_inference_service(example_service("smollm2", **SPEC)).spec
    policy = Policy(params_from_spec(spec), spec_config(spec))
    out = []
    for obs in script():
        decision = policy.decide(obs)
        out.append((decision.kind, decision.config.short() if decision.config else None))
    return out


def test_the_operator_the_local_fleet_and_the_simulator_take_the_same_decisions(
    fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    operator, status = operator_host(fake_kube, monkeypatch)
    local, scaled = local_host()
    sim, fleet, most = sim_host()

    assert len(operator) == INTERVALS, operator
    assert local == operator, f"local fleet:\n{local}\noperator:\n{operator}"
    assert sim == operator, f"simulator:\n{sim}\noperator:\n{operator}"

    # The script is one where the replica knob's room matters: the config leaves the overload to it and
    # keeps its 16 sequences while the knob adds replicas; the config policy alone (what the simulator
    # ran before it shared the sequence) cuts the batch on the same observations.
    counts = [replicas for _, _, _, replicas in operator]
    assert max(counts) > 1, operator
    assert all(config is None or "seqs=16 " in config for _, config, _, _ in operator), operator
    alone = config_policy_alone()
    assert any(config is not None and "seqs=16 " not in config for _, config in alone), alone
    # each host acted on the count the decisions reached, its own way
    final = counts[-1]
    assert status["autoscaling"]["replicas"] == final, status["autoscaling"]
    assert scaled and scaled[-1] == final, scaled
    assert most == final and len(fleet.active) == final
