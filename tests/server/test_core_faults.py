"""Issue 33, the engine core's side: requests in flight when the core dies get 503 + Retry-After (an SSE
error event a router can recognise when streamed), a hung core is noticed without anyone polling /ready,
an engine whose requests cannot be scheduled sleeps and records no steps, and a slow stream reader costs
one pending output, not one per step."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import wait_for

BUNDLED = "bundled://smollm2-135m-instruct"


def _served(serve_app: Any, **config: Any) -> Iterator[tuple[Any, str, list[str]]]:
    from specfleet.engine import EngineConfig
    from specfleet.engine.core.client import EngineCoreClient
    from specfleet.engine.server.app import build_state, create_app

    heartbeat = config.pop("heartbeat_timeout_s", 60.0)
    client = EngineCoreClient(EngineConfig(**config), log_level="warning", heartbeat_timeout_s=heartbeat)
    deaths: list[str] = []
    client.on_dead.append(deaths.append)
    uv, thread, url = serve_app(create_app(build_state(client, admin_token="t")))
    try:
        yield client, url, deaths
    finally:
        uv.should_exit = True
        thread.join(15)
        if client.proc.poll() is None:
            os.kill(client.proc.pid, signal.SIGCONT)
        client.stop()


@pytest.fixture
def bundled_server(serve_app: Any, request: pytest.FixtureRequest) -> Iterator[tuple[Any, str, list[str]]]:
    yield from _served(
        serve_app, model=BUNDLED, max_model_len=512, kv_cache_gib=0.05, **getattr(request, "param", {})
    )


def _in_background(fn: Any) -> tuple[dict[str, Any], threading.Thread]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            fn(result)
        except Exception as exc:  # recorded, asserted by the test
            result["exception"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return result, thread


def _long_requests(
    url: str,
) -> tuple[dict[str, Any], dict[str, Any], threading.Event, list[threading.Thread]]:
    """One non-streamed and one streamed request of 400 tokens; the event is set at the stream's first
    token (both are then in flight)."""
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True}
    started = threading.Event()

    def plain(result: dict[str, Any]) -> None:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        result.update(status=resp.status_code, headers=dict(resp.headers), body=resp.json())

    def streamed(result: dict[str, Any]) -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as resp:
            result["status"], result["events"] = resp.status_code, []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(line[6:])
                    if '"text"' in line:
                        started.set()

    (plain_result, t1), (stream_result, t2) = _in_background(plain), _in_background(streamed)
    return plain_result, stream_result, started, [t1, t2]


def _wait_both_in_the_core(client: Any) -> None:
    """Until the plain request is in the core beside the stream: the stream's first token says nothing of the
    other thread's request, which a loaded host may not have sent yet."""
    wait_for("both requests in the engine core", lambda: client.num_in_flight == 2, timeout=60, interval=0.05)


def _assert_engine_dead(plain: dict[str, Any], streamed: dict[str, Any], why: str) -> None:
    assert plain.get("status") == 503, plain
    assert plain["headers"].get("retry-after") == "5", plain["headers"]
    error = plain["body"]["error"]
    assert error["code"] == "engine_dead" and error["type"] == "service_unavailable", error
    assert why in error["message"], error
    events = streamed["events"]
    assert streamed["status"] == 200 and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["error"]["code"] == "engine_dead" and why in last["error"]["message"], last


@pytest.mark.slow
def test_requests_in_flight_when_the_core_dies_get_503_with_retry_after(bundled_server: Any) -> None:
    client, url, deaths = bundled_server
    plain, streamed, started, threads = _long_requests(url)
    assert started.wait(90), streamed
    _wait_both_in_the_core(client)
    os.kill(client.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    # Before: the plain request got 500 `internal_error`, the stream a 500 `engine_error` event.
    _assert_engine_dead(plain, streamed, "killed by SIGKILL")
    assert len(deaths) == 1


@pytest.mark.slow
@pytest.mark.parametrize("bundled_server", [{"heartbeat_timeout_s": 3.0}], indirect=True)
def test_a_hung_core_is_noticed_without_polling_ready(bundled_server: Any) -> None:
    """SIGSTOP: the core's process lives and sends nothing. Nobody polls /ready here; the client's watchdog
    declares it hung after heartbeat_timeout_s, fails what is in flight with 503 and kills it."""
    client, url, deaths = bundled_server
    plain, streamed, started, threads = _long_requests(url)
    assert started.wait(90), streamed
    _wait_both_in_the_core(client)
    os.kill(client.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    for thread in threads:
        thread.join(30)
    assert time.monotonic() - stopped_at < 15, "the hang was not noticed by itself"
    _assert_engine_dead(plain, streamed, "hung")
    assert len(deaths) == 1 and re.search(r"no report from the engine core \(pid \d+\) for \d+ s", deaths[0])
    assert client.proc.wait(10) == -signal.SIGKILL  # a hung core is killed, not left holding the model
    assert httpx.get(f"{url}/ready", timeout=5).json() == {"ready": False, "reason": "engine_core_dead"}


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _step_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r"^specfleet_step_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert match, text[:2000]
    return float(match.group(1))


@pytest.mark.slow
def test_a_request_that_cannot_be_scheduled_does_not_spin_the_core(serve_app: Any, tiny_llama: str) -> None:
    """A prefill engine's KV hold keeps 3 of its 4 blocks for a decode engine that never comes; the next
    request needs 3 blocks and waits for the hold to expire. Before, the core stepped in a busy loop (one
    CPU core) and reported every empty step as a step (the step histogram grew by thousands a second)."""
    served = _served(
        serve_app,
        model=tiny_llama,
        max_model_len=64,
        block_size=16,
        num_kv_blocks=4,
        kv_role="prefill",
        kv_transfer_timeout_s=60.0,
    )
    client, url, _ = next(served)
    try:
        held = httpx.post(
            f"{url}/v1/completions",
            json={
                "prompt": list(range(100, 140)),
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
            timeout=60,
        )
        assert held.status_code == 200 and "kv_transfer_params" in held.json(), held.text
        waiting, thread = _in_background(
            lambda result: result.update(
                resp=httpx.post(
                    f"{url}/v1/completions",
                    json={"prompt": list(range(200, 240)), "max_tokens": 4},
                    timeout=10,  # past the window below, which a loaded host stretches
                )
            )
        )
        # the request is in the core and cannot be scheduled
        wait_for("the request in the engine core", lambda: client.num_in_flight == 1, timeout=30)
        steps, cpu = _step_count(url), _cpu_seconds(client.pid)
        time.sleep(2.0)
        steps_after, cpu_after = _step_count(url), _cpu_seconds(client.pid)
        assert client.num_in_flight == 1, waiting  # it waited all through the window
        assert steps_after == steps, f"{steps_after - steps} empty steps recorded as steps"
        assert cpu_after - cpu < 0.3, f"the core used {cpu_after - cpu:.2f} s of CPU in 2 s while waiting"
        thread.join(15)
    finally:
        next(served, None)


@pytest.mark.slow
def test_a_paused_stream_reader_holds_one_merged_output(server: Any) -> None:
    """The reader does not read while the engine produces 48 tokens: the stream holds one pending output
    (the latest, cumulative), not one per step, and the text read afterwards is the unpaused text."""
    from specfleet.engine import SamplingParams

    client = server.async_engine
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)

    async def run(pause: bool) -> tuple[str, int]:
        stream = await client.generate(f"paused-{pause}-{time.monotonic_ns()}", "Count: 1, 2, 3,", params)
        most_pending = 0
        if pause:
            while not stream.finished:
                most_pending = max(most_pending, stream.num_pending)
                await asyncio.sleep(0.01)
        text = ""
        async for output in stream:
            text = output.outputs[0].text
        return text, most_pending

    def blocking(pause: bool) -> tuple[str, int]:
        return asyncio.run_coroutine_threadsafe(run(pause), client._loop).result(120)

    unpaused, _ = blocking(False)
    paused, most_pending = blocking(True)
    assert most_pending == 1
    assert paused == unpaused and len(unpaused) > 20
