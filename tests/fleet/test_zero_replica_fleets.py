"""`specfleet up`'s life cycle on fleets that start with no engine (`minReplicas: 0`): they start and stop in
a second, so what the fleet and the gateway do around them (scale from zero, a failed start, Ctrl-C) is
seen without waiting for a model. Real routers and gateway on sockets; an engine process is started only
where the case needs one (a tiny random-weight llama)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from helpers import free_port
from specfleet.fleet.supervisor import LocalFleet
from specfleet.operator.inference_service import load_inference_service

pytestmark = pytest.mark.timeout(120)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml"


def service(name: str, source: str, replicas: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    spec["model"].update(source=source, maxModelLen=512)
    spec["engine"]["drainTimeoutSeconds"] = 2
    spec["replicas"] = replicas
    if replicas == 0:
        spec["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 1}
        spec["autotune"] = {"enabled": True}  # the replica knob is the tuner's
    spec["routing"] = {"queueTimeoutSeconds": 60}
    return doc


def fleet_of(doc: dict[str, Any], **options: Any) -> LocalFleet:
    return LocalFleet(
        load_inference_service(doc),
        interval_s=600,  # longer than any test here: the tuner's one interval is its first, at start
        engine_extra_args=["--kv-cache-gib=0.05"],
        **options,
    )


def test_each_scale_from_zero_leaves_no_finished_task_behind(tiny_llama: str) -> None:
    """A fleet that scales from zero many times over a long run keeps only the work still running."""
    said: list[str] = []
    fleet = fleet_of(service("llm", tiny_llama), say=said.append)

    async def run() -> list[asyncio.Task[None]]:
        await fleet.start(ready_timeout_s=5)
        assert fleet.engines == []
        async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
            held = asyncio.create_task(
                client.post("/v1/completions", json={"model": "llm", "prompt": "hi", "max_tokens": 1})
            )
            try:
                while not fleet.engines:  # the router holds the request and asks the fleet for a replica
                    assert not held.done(), held
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.1)  # the scale from zero has returned: its task's callbacks run
                return [t for t in fleet._tasks if t.done()]
            finally:
                held.cancel()
                await asyncio.gather(held, return_exceptions=True)
                await fleet.stop(drain_timeout_s=0)

    assert asyncio.run(run()) == []
    assert any("scaling up: started engine 0" in line for line in said), said
    assert not any(e.running for e in fleet.engines)


class Watched(LocalFleet):
    """A fleet that notes, when it is told to stop, whether its own start was still running then."""

    starting = False
    stopped_while_starting: list[bool] | None = None

    async def start(self, ready_timeout_s: float | None = None) -> None:
        self.starting = True
        try:
            await super().start(ready_timeout_s)
        finally:
            self.starting = False

    async def stop(self, drain_timeout_s: float | None = None) -> list[int | None]:
        if self.stopped_while_starting is not None:
            self.stopped_while_starting.append(self.starting)
        return await super().stop(drain_timeout_s)


def test_a_service_that_fails_to_start_cancels_the_others_start_ups_before_they_stop(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specfleet up -f a.yaml -f b.yaml` where a cannot start: b's start-up ends (its engine killed) before
    anything is stopped, and nothing of it is left running once `up` returns."""
    from specfleet.fleet.local import serve_fleets

    # a pvc:// model is the cluster's: `up` refuses it before starting any engine
    broken = Watched(load_inference_service(service("broken", "pvc://models/llm", replicas=1)))
    starting = Watched(
        load_inference_service(service("llm", tiny_llama, replicas=1)),
        engine_extra_args=["--kv-cache-gib=0.05"],
    )
    seen: list[bool] = []
    broken.stopped_while_starting = starting.stopped_while_starting = seen

    async def never() -> None:
        raise AssertionError("a start that failed reported the fleets started")

    async def run() -> tuple[int, list[asyncio.Task[Any]]]:
        code = await serve_fleets([broken, starting], never)
        return code, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        code, left = asyncio.run(run())
    finally:
        for engine in starting.engines:
            engine.kill()  # whatever the code under test left running
    assert code == 1
    assert "model.source='pvc://models/llm' cannot run locally" in capsys.readouterr().err
    assert seen == [False, False]  # neither was stopped while its start was still running
    assert left == []
    assert len(starting.engines) == 1 and starting.engines[0].proc is not None
    assert starting.engines[0].proc.returncode == -9  # killed by its cancelled start, not left to stop


def test_ctrl_c_makes_the_gateway_refuse_and_close_connections_while_the_services_stop(
    tiny_llama: str, tmp_path: Path
) -> None:
    """`specfleet up -f a.yaml -f b.yaml`, then Ctrl-C: as one service's router does, the gateway's /ready
    fails and its responses close their connections from the signal on, while each service drains."""
    from specfleet.fleet.local import run_gateway

    port = free_port()
    ready = f"http://127.0.0.1:{port}/ready"
    seen: list[tuple[int, str | None]] = []  # the gateway's /ready as each service is told to stop

    class Probed(LocalFleet):
        async def stop(self, drain_timeout_s: float | None = None) -> list[int | None]:
            async with httpx.AsyncClient(timeout=5) as client:
                answer = await client.get(ready)
            seen.append((answer.status_code, answer.headers.get("connection")))
            return await super().stop(drain_timeout_s)

    files = [tmp_path / "v1.yaml", tmp_path / "v2.yaml"]
    for file, name in zip(files, ("llm-v1", "llm-v2"), strict=True):
        file.write_text(yaml.safe_dump(service(name, tiny_llama)))
    fleets = [Probed(load_inference_service(str(file)), interval_s=600) for file in files]

    async def ctrl_c_once_serving() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                try:
                    if (await client.get(ready)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                await asyncio.sleep(0.05)
        signal.raise_signal(signal.SIGINT)  # `up` handles it on its loop

    async def run() -> int:
        trigger = asyncio.create_task(ctrl_c_once_serving())
        code = await run_gateway(fleets, [str(f) for f in files], "127.0.0.1", port, 0.5)
        await trigger
        return code

    assert asyncio.run(run()) == 0
    assert seen == [(503, "close"), (503, "close")]
