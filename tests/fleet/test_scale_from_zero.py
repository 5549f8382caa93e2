"""Scale from zero in `specfleet up`, closed loop: `minReplicas: 0` and no engine; a request arrives, the
router holds it and calls the fleet (`_on_queue`), which starts an engine at once; the engine starts on the
tuner's config in force (its `--live-config-file`), answers the held request, and the cold start is
reported (the supervisor's line, the router's gauge). A restart after a crash starts tuned too:
tests/fleet/test_supervision.py. Real engine (a tiny random-weight llama), real router; the tuner's
interval is longer than the test, so no push of the tuner's reaches the engine: the config it runs is the
one it started on."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import yaml
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator.inference_service import load_inference_service
from specfleet.tuner.types import LiveSettings, TunedConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "smollm2-cpu.yaml")
# What the tuner had pushed before the fleet went to zero: none of it is the spec's (k 0, 16 seqs, 512)
TUNED = LiveSettings(TunedConfig(3, 8, 1024), speculative_disable_by_batch_size=4)


async def until(what: str, check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_held_request_starts_a_tuned_engine_and_the_cold_start_is_reported(tiny_llama: str) -> None:
    doc = yaml.safe_load(open(EXAMPLE).read())
    spec = doc["spec"]
    spec["model"].update(source=tiny_llama, maxModelLen=512)
    spec["engine"]["drainTimeoutSeconds"] = 2
    spec.update(
        replicas=0,
        speculative={"method": "ngram", "numSpeculativeTokens": 0},
        autotune={"enabled": True},
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1},
        routing={"queueTimeoutSeconds": 60},
    )
    said: list[str] = []
    fleet = LocalFleet(
        load_inference_service(doc),
        interval_s=600,
        engine_extra_args=["--kv-cache-gib=0.05"],
        say=said.append,
    )

    async def run() -> dict[str, int]:
        await fleet.start(ready_timeout_s=5)
        assert fleet.tuner is not None and fleet.engines == []
        fleet.tuner.policy.current, fleet.tuner.in_force = TUNED.config, TUNED
        try:
            async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
                model = tiny_llama.rstrip("/").rsplit("/", 1)[1]  # a folder's model is served by its name
                body = {"model": model, "prompt": "Hello there", "max_tokens": 4}
                sent = asyncio.create_task(client.post("/v1/completions", json=body))
                await until("the request to be held", lambda: fleet.router.queued == 1, 10)
                await until("an engine to start", lambda: len(fleet.engines) == 1, 5)  # not an interval later
                response = await sent
                assert response.status_code == 200, response.text
                (engine,) = fleet.engines
                admin = {"Authorization": f"Bearer {fleet.token}"}
                started_on = await client.get(f"{fleet.admin_url(engine.url)}/admin/config", headers=admin)
                return started_on.json()
        finally:
            await fleet.stop(drain_timeout_s=2)

    assert asyncio.run(run()) == TUNED.as_admin(), said
    assert [(d.previous, d.replicas) for d in fleet.replica_decisions if d.changed] == [(0, 1)]
    assert fleet.cold_start_s is not None and fleet.cold_start_s > 0
    assert fleet.router.cold_start_s is not None  # the held request's wait, exported as this gauge:
    gauge = fleet.router.metrics.registry.get_sample_value("specfleet_router_cold_start_seconds")
    assert gauge == pytest.approx(fleet.router.cold_start_s)
    assert any(line.startswith("[autoscaler] cold start: engine 0 ready") for line in said), said
    assert [(s.index, s.cause) for s in fleet.startups] == [(0, "scale-up")]
    assert any(line.startswith("[fleet] engine 0 ready") and "after its scale-up" in line for line in said)
