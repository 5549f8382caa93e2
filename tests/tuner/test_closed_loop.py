"""Closed loop with real parts: two engine processes, a real Prometheus scraping them, the tuner on PromQL.

Low load on input-grounded prompts should turn speculation on; high load should turn it off; the engines'
live config must follow each decision, and every decision must say why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx
import pytest
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator import load_inference_service
from specfleet.tuner.actuator import AdminActuator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ISVC = {
    "apiVersion": "serving.specfleet.io/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "loop"},
    "spec": {
        "model": {"source": "bundled://smollm2-135m-instruct", "dtype": "float32", "maxModelLen": 1024},
        "engine": {"drainTimeoutSeconds": 5},
        "batching": {"maxNumSeqs": 16, "maxNumBatchedTokens": 512},
        "speculative": {"method": "ngram", "numSpeculativeTokens": 0},
        "replicas": 2,
        "resources": {"gpus": 0},
        "slo": {"ttftP95Ms": 8000, "tpotP95Ms": 600},
        "autotune": {
            "enabled": True,
            "intervalSeconds": 5,
            "bounds": {
                "numSpeculativeTokens": [0, 4],
                "maxNumSeqs": [4, 32],
                "maxNumBatchedTokens": [256, 2048],
            },
        },
    },
}
GROUNDED = (
    "Copy this list exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
    "Copy: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
)
TICK_S = 3.0


async def _load(
    url: str, concurrency: int, prompt: Callable[[int], str], max_tokens: int, stop: asyncio.Event
) -> None:
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                body = {
                    "model": "smollm2-135m-instruct",
                    "prompt": prompt(w * 1000 + i),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                with contextlib.suppress(httpx.HTTPError):
                    await client.post(f"{url}/v1/completions", json=body)
                i += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))


async def _phase(
    fleet: LocalFleet,
    admin: AdminActuator,
    concurrency: int,
    prompt: Callable[[int], str],
    max_tokens: int,
    done: Callable[[list[int]], bool],
    timeout_s: float,
) -> list[int]:
    stop = asyncio.Event()
    load = asyncio.create_task(_load(fleet.url, concurrency, prompt, max_tokens, stop))
    deadline = time.monotonic() + timeout_s
    ks: list[int] = []
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
            tick = await fleet.tick()
            print(f"[{concurrency=}] {tick.decision.kind}: {tick.decision.reason[:200]}")
            ks = [(await admin.read(u)).num_speculative_tokens for u in fleet.engine_urls]
            if done(ks):
                break
    finally:
        stop.set()
        await load
    return ks


def test_tuner_turns_speculation_on_at_low_load_and_off_at_high_load(prometheus_factory) -> None:
    isvc = load_inference_service(ISVC)

    async def scenario() -> None:
        fleet = LocalFleet(
            isvc,
            tune=False,
            interval_s=TICK_S,
            window_s=6.0,
            engine_extra_args=["--kv-cache-gib", "0.25", "--log-level", "warning"],
        )
        await fleet.start(ready_timeout_s=240)
        admin = AdminActuator(fleet.token, admin_url=fleet.admin_url)
        try:
            fleet.prometheus_url = prometheus_factory("loop", fleet.engine_urls)
            fleet.tuner = fleet.new_tuner()
            on = await _phase(fleet, admin, 1, lambda i: GROUNDED, 24, lambda ks: all(k > 0 for k in ks), 100)
            assert on and all(k > 0 for k in on), [t.decision.reason for t in fleet.ticks]
            # with speculation on, each engine also stops proposing past the batch the tuner would turn it
            # off at: one request each now, and that rule waits for 4 more requests (2 more each), so >= 2
            guards = [
                (await admin.settings(u))["speculative_disable_by_batch_size"] for u in fleet.engine_urls
            ]
            assert guards == [fleet.tuner.policy.guard] * 2 and guards[0] >= 2, guards
            off = await _phase(
                fleet,
                admin,
                24,
                lambda i: f"Write a story about animal number {i}.",
                16,
                lambda ks: all(k == 0 for k in ks),
                100,
            )
            assert off and all(k == 0 for k in off), [t.decision.reason for t in fleet.ticks]
        finally:
            await admin.close()
            codes = await fleet.stop(drain_timeout_s=5)
        decisions = [t.decision for t in fleet.ticks]
        assert all(d.reason for d in decisions)
        assert any(t.observation.error is None for t in fleet.ticks), "no PromQL observation ever succeeded"
        # before the first change (k = 0) PromQL read the engines' shadow drafts on the grounded prompt
        shadow = [t.observation for t in fleet.ticks if t.observation.shadow_accepted_per_pos]
        assert any(o.shadow_share and o.shadow_accepted_per_pos[0] > 0 for o in shadow), shadow[:2]
        changes = [d for d in decisions if d.changed]
        assert changes and all("->" in d.reason or "reverted" in d.reason for d in changes)
        assert codes == [0, 0]

    asyncio.run(scenario())
