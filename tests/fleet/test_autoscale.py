"""The closed loop in `specfleet up`: under load the tuner's replica knob takes a fleet from 1 engine to
2, the new engine joins routing and gets the tuned config, and once the load is gone it goes back to 1.
Real engines (a tiny random-weight llama), real router, the tuner scraping the engines directly."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import yaml
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator.inference_service import load_inference_service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "smollm2-cpu.yaml")


def test_replicas_go_1_2_1_with_the_load(tiny_llama: str) -> None:
    doc = yaml.safe_load(open(EXAMPLE).read())
    spec = doc["spec"]
    spec["model"].update(source=tiny_llama, maxModelLen=512)
    spec["engine"]["drainTimeoutSeconds"] = 2
    # two sequences per engine (the tuner may not raise it): eight concurrent requests leave six waiting
    spec["batching"] = {"maxNumSeqs": 2, "maxNumBatchedTokens": 512}
    spec["autotune"] = {"enabled": True, "bounds": {"maxNumSeqs": [2, 2], "maxNumBatchedTokens": [512, 512]}}
    spec["slo"] = {"ttftP95Ms": 1, "tpotP95Ms": 1}  # missed under any load: the load decides, not the machine
    spec["autoscaling"] = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 2,
        "scaleDownStabilizationSeconds": 3,
        "cooldownSeconds": 2,
    }
    said: list[str] = []
    fleet = LocalFleet(
        load_inference_service(doc),
        interval_s=1.0,
        window_s=2.0,
        engine_extra_args=["--kv-cache-gib=0.05"],
        say=said.append,
    )

    async def run() -> None:
        await fleet.start(ready_timeout_s=120)
        stop = asyncio.Event()
        try:
            async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]

                async def user() -> None:
                    while not stop.is_set():
                        await client.post(
                            "/v1/completions",
                            json={
                                "model": model,
                                "prompt": "Count: 1 2 3",
                                "max_tokens": 48,
                                "ignore_eos": True,
                            },
                        )

                users = [asyncio.create_task(user()) for _ in range(8)]
                deadline = time.monotonic() + 120
                while len(fleet.ready_urls()) < 2:
                    assert time.monotonic() < deadline, said
                    await asyncio.sleep(0.2)
                await asyncio.sleep(2)  # both engines take requests
                stop.set()
                await asyncio.gather(*users)
            deadline = time.monotonic() + 60
            while len(fleet.engines) > 1:
                assert time.monotonic() < deadline, said
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await fleet.stop(drain_timeout_s=2)

    asyncio.run(run())
    changes = [d for d in fleet.replica_decisions if d.changed]
    assert [(d.previous, d.replicas) for d in changes] == [(1, 2), (2, 1)], said
    assert changes[0].kind == "scale-up" and changes[1].kind == "scale-down" and "idle" in changes[1].reason
    assert any(line.startswith("[autoscaler] scale-up: scale-up 1 -> 2") for line in said)
    assert any("scaling down: draining engine 1" in line for line in said)
