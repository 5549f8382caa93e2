"""`specfleet up` with spec.disaggregation: the fleet starts a prefill and a decode engine (real processes,
a tiny random-weight llama) with their --kv-role, gives the router both roles, and a completion through the
router runs its prompt on the prefill engine and its tokens on the decode engine, with the answer the
decode engine gives aggregated."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import yaml
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator.inference_service import load_inference_service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "smollm2-cpu.yaml")


def _successes(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("specfleet_request_success_total")
    )


def test_disaggregated_local_fleet_routes_prefill_then_decode(tiny_llama: str) -> None:
    doc = yaml.safe_load(open(EXAMPLE).read())
    doc["spec"]["model"]["source"] = tiny_llama
    doc["spec"]["model"]["maxModelLen"] = 512
    doc["spec"]["engine"]["drainTimeoutSeconds"] = 2
    doc["spec"]["disaggregation"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    fleet = LocalFleet(
        load_inference_service(doc), tune=False, engine_extra_args=["--kv-cache-gib=0.05"], say=lambda _: None
    )

    async def run() -> None:
        await fleet.start(ready_timeout_s=120)
        try:
            prefill, decode = fleet.engines
            assert (prefill.role, decode.role) == ("prefill", "decode")
            assert "--kv-role=prefill" in prefill.command and "--kv-role=decode" in decode.command
            assert [e.url for e in fleet.router.endpoints.routable()] == [decode.url]  # never a decode target
            assert [e.url for e in fleet.router.endpoints.prefill_routable()] == [prefill.url]
            async with httpx.AsyncClient(timeout=60) as client:
                model = (await client.get(f"{fleet.url}/v1/models")).json()["data"][0]["id"]
                body = {
                    "model": model,
                    "prompt": "Hello there, how are",
                    "max_tokens": 6,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                before = _successes((await client.get(f"{prefill.url}/metrics")).text)
                routed = await client.post(f"{fleet.url}/v1/completions", json=body)
                assert routed.status_code == 200, routed.text
                after = _successes((await client.get(f"{prefill.url}/metrics")).text)
                assert after == before + 1  # the prompt ran on the prefill engine
                direct = await client.post(
                    f"{decode.url}/v1/completions", json=body
                )  # aggregated, same engine
                assert routed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
                assert routed.json()["usage"]["completion_tokens"] == 6
        finally:
            await fleet.stop(drain_timeout_s=2)

    asyncio.run(run())
