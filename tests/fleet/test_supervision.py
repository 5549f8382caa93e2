"""`specfleet up` supervises its engines like a Deployment: kill -9 one of two engines and it leaves
routing at once (requests keep succeeding on the survivor), is reported with its exit code and last log
lines, is reaped (no zombie) and comes back after its backoff, on the tuner's config in force (its
--live-config-file). Then scaling 2 -> 1 drains the newest. Real engines (a tiny random-weight llama), real
router, real sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import yaml
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator.inference_service import load_inference_service
from specfleet.tuner.types import LiveSettings, TunedConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "smollm2-cpu.yaml")


def tiny_fleet(tiny_llama: str, replicas: int, **fleet_options: object) -> LocalFleet:
    doc = yaml.safe_load(open(EXAMPLE).read())
    doc["spec"]["model"]["source"] = tiny_llama
    doc["spec"]["model"]["maxModelLen"] = 512
    doc["spec"]["replicas"] = replicas
    doc["spec"]["engine"]["drainTimeoutSeconds"] = 2
    options = {"tune": False, **fleet_options}
    return LocalFleet(load_inference_service(doc), engine_extra_args=["--kv-cache-gib=0.05"], **options)


async def until(what: str, check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_kill_9_of_one_engine_is_reported_rerouted_and_restarted(tiny_llama: str) -> None:
    said: list[str] = []

    async def run() -> None:
        # tuning on, with an interval longer than the test: its one push is the first tick's, at start
        # each engine on one core of its own (fleet/cores.py): a restart keeps its cores, a retirement frees them
        pinned = 1 if len(os.sched_getaffinity(0)) >= 2 else None
        fleet = tiny_fleet(
            tiny_llama,
            2,
            say=said.append,
            policy="round-robin",
            tune=True,
            interval_s=600,
            cpus_per_engine=pinned,
        )
        await fleet.start(ready_timeout_s=120)
        try:
            await until("the tuner's first push", lambda: bool(fleet.ticks), 30)
            assert fleet.tuner is not None and fleet.tuner.in_force is not None  # the spec's config, accepted
            tuned = LiveSettings(TunedConfig(0, 8, 1024))  # as if a later interval had tuned it
            fleet.tuner.policy.current, fleet.tuner.in_force = tuned.config, tuned
            victim, survivor = fleet.engines
            if pinned:
                assert victim.cpus is not None and survivor.cpus is not None
                assert len(victim.cpus) == len(survivor.cpus) == 1 and not victim.cpus & survivor.cpus
                assert victim.proc is not None and os.sched_getaffinity(victim.proc.pid) == victim.cpus
            async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": "Hello there", "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                assert victim.proc is not None
                os.kill(victim.proc.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                await until(
                    "the dead engine to leave routing",
                    lambda: not fleet.router.endpoints.get(victim.url).ready,
                    5,
                )
                assert time.monotonic() - killed_at < 1.0  # at once, not after a readiness probe's failures
                for _ in range(6):  # round-robin would alternate: every one must land on the survivor
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                ok = fleet.router.metrics.requests.labels(survivor.url, "ok")._value.get()
                assert ok >= 6
                report = next(line for line in said if "exited" in line)
                assert f"engine {victim.index} ({victim.url}) exited (killed by SIGKILL)" in report
                assert "Last log lines" in report and "restarting in 1s" in report
                assert victim.exit_codes == [-9]  # reaped: no zombie left behind
                await until("the restart", lambda: any("restarting engine 0" in line for line in said), 10)
                await until(
                    "the restarted engine to be ready",
                    lambda: fleet.router.endpoints.get(victim.url).ready,
                    60,
                )
                assert victim.restarts == 1 and victim.running
                if pinned:
                    assert victim.proc is not None and os.sched_getaffinity(victim.proc.pid) == victim.cpus
                admin = {"Authorization": f"Bearer {fleet.token}"}
                restarted = await client.get(f"{fleet.admin_url(victim.url)}/admin/config", headers=admin)
                assert {k: restarted.json()[k] for k in tuned.as_admin()} == tuned.as_admin()  # started tuned
                assert [(s.index, s.cause) for s in fleet.startups][-1] == (victim.index, "restart")
                # scale 2 -> 1: the newest engine drains and stops (scale-up: tests/fleet/test_autoscale.py)
                await fleet.scale_to(1)
                await until("the retired engine to stop", lambda: len(fleet.engines) == 1, 30)
                assert [e.url for e in fleet.router.endpoints.routable()] == [victim.url]
                if pinned:  # the retired engine's core is free again; the survivor's is still held
                    assert survivor.cpus is not None and victim.cpus is not None
                    assert all(fleet.cores.held[c] == 0 for c in survivor.cpus)
                    assert all(fleet.cores.held[c] == 1 for c in victim.cpus)
                assert any(
                    f"engine {survivor.index} ({survivor.url}) stopped (exit code 0)" in line for line in said
                )
                assert (await client.post("/v1/completions", json=body)).status_code == 200
        finally:
            codes = await fleet.stop(drain_timeout_s=5)
        assert codes == [0], (codes, said, [e.tail() for e in fleet.engines])

    asyncio.run(run())


def test_a_start_that_times_out_leaves_no_engine_process(tiny_llama: str) -> None:
    async def run() -> None:
        fleet = tiny_fleet(tiny_llama, 2)
        with pytest.raises(TimeoutError, match="engines not ready after 0s"):
            await fleet.start(ready_timeout_s=0.3)
        assert len(fleet.engines) == 2 and not any(e.running for e in fleet.engines)
        assert all(
            e.exit_codes == [] and e.proc is not None and e.proc.returncode == -9 for e in fleet.engines
        )

    asyncio.run(run())
