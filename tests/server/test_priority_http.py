"""Priority scheduling through a real server (`--scheduling-policy priority`): with the KV cache full of
low-priority streams, a high-priority request's time to first token stays within 2x its time on an idle
engine, and every low-priority request finishes with the tokens of an undisturbed greedy run (the
preempted ones are recomputed and resume). The same load under fcfs makes the same request wait past 2x:
the load is real. A priority under fcfs is a 400 in vLLM's words.

The time to first token is compared as the engine core's CPU time over it (the work the engine did before
the first token), not as wall time: on the shared 2-core host (load 3) three idle runs in a row read
0.99-1.41 s of wall time at 0.75-0.78 s of the core's CPU, so a host that gets busier between the idle and
the loaded runs moves the wall ratio as much with no change in the scheduling. The same run's ratios:
priority 1.46x wall, 1.42x CPU; fcfs 5.0x wall, 5.9x CPU."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from helpers import serve_in_thread

pytestmark = pytest.mark.slow

MODEL = "bundled://smollm2-135m-instruct"
BLOCK = 16
NUM_BLOCKS = 40  # 8 low streams of 48 + 96 tokens need 72 blocks: the cache is full of them
NUM_LOW = 8
LOW_TOKENS = 96
LOW_PRIORITY, HIGH_PRIORITY = 5, 0
HIGH_TOKENS = 4
# A long prompt, so that the high request's own prefill is most of its time to first token on an idle
# engine too, as for an interactive request with a system prompt; distinct salts keep every measurement
# off the prefix cache.
HIGH_PROMPT = " ".join(f"Item {i} of the list is a colour." for i in range(28))
LOW_PROMPTS = [f"Story {i}: " + " ".join(["Once upon a time, a fox walked far."] * 4) for i in range(NUM_LOW)]


@contextmanager
def _server(policy: str) -> Iterator[tuple[str, int]]:
    """A server over an engine core scheduling by `policy`: (its URL, the core's pid)."""
    from specfleet.engine import EngineConfig
    from specfleet.engine.core.client import EngineCoreClient
    from specfleet.engine.server.app import build_state, create_app

    config = EngineConfig(
        model=MODEL,
        max_model_len=512,
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        scheduling_policy=policy,
    )
    client = EngineCoreClient(config, log_level="warning")
    uv, thread, url = serve_in_thread(create_app(build_state(client, max_waiting=256)))
    try:
        assert httpx.get(f"{url}/ready", timeout=30).status_code == 200
        yield url, client.pid
    finally:
        uv.should_exit = True
        thread.join(15)
        client.stop()


def _core_cpu_s(pid: int) -> float:
    """The engine core's CPU seconds so far, all its threads (utime and stime from /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ttft(url: str, core: int, salt: str, priority: int | None) -> tuple[float, float]:
    """The high request's time to first token: (wall seconds, the engine core's CPU seconds meanwhile)."""
    body: dict[str, Any] = {
        "prompt": HIGH_PROMPT,
        "max_tokens": HIGH_TOKENS,
        "temperature": 0,
        "stream": True,
        "cache_salt": salt,
    }
    if priority is not None:
        body["priority"] = priority
    start, cpu = time.monotonic(), _core_cpu_s(core)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"text"' in line:
                first = (time.monotonic() - start, _core_cpu_s(core) - cpu)
                for _ in lines:  # read to the end: the request finishes and frees its blocks
                    pass
                return first
    raise AssertionError("the stream ended without a token")


def _low(url: str, i: int, priority: int | None, salt: str, out: dict[int, list[int]]) -> None:
    body: dict[str, Any] = {
        "prompt": LOW_PROMPTS[i],
        "cache_salt": salt,
        "max_tokens": LOW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if priority is not None:
        body["priority"] = priority
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    out[i] = choice["token_ids"]


def _metric(url: str, name: str) -> float:
    """The sum of a metric's series (over its labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


def _run_low(
    url: str, priority: int | None, salt: str
) -> tuple[list[threading.Thread], dict[int, list[int]]]:
    """The low-priority streams, each in a thread; their token ids land in the dict as they finish. The
    salt keeps a run off the previous one's cached blocks, so that it computes everything again."""
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=_low, args=(url, i, priority, salt, out)) for i in range(NUM_LOW)]
    for t in threads:
        t.start()
    return threads, out


def _wait_full(url: str, threads: list[threading.Thread]) -> bool:
    """Wait until the low streams hold (nearly) every block: they are decoding and the cache is full.
    False when they have all finished (under fcfs the first loaded request waits for them)."""
    deadline = time.monotonic() + 300
    while _metric(url, "specfleet_kv_cache_usage_ratio") < 0.9:
        if not any(t.is_alive() for t in threads):
            return False
        assert time.monotonic() < deadline, "the low-priority streams never filled the cache"
        time.sleep(0.1)
    return True


@dataclass
class Run:
    idle_s: float  # median TTFT of the high request on the idle engine
    loaded_s: float  # median TTFT of the high request with the cache full of low streams
    idle_cpu_s: float  # the engine core's CPU time over those TTFTs (medians)
    loaded_cpu_s: float
    displaced: float  # running requests preempted for a higher-priority one meanwhile
    equal: bool  # every low stream's tokens equal to its undisturbed run's


def _measure(policy: str) -> Run:
    prioritised = policy == "priority"
    low, high = (LOW_PRIORITY, HIGH_PRIORITY) if prioritised else (None, None)
    with _server(policy) as (url, core):
        if not prioritised:
            _check_refusal(url)
        _ttft(url, core, "warm-up", high)
        idle = [_ttft(url, core, f"idle-{k}", high) for k in range(3)]
        threads, undisturbed = _run_low(url, low, "undisturbed")
        for t in threads:
            t.join(900)
        threads, disturbed = _run_low(url, low, "disturbed")
        loaded = []
        before = _metric(url, "specfleet_num_priority_preemptions_total")
        for k in range(2):
            if _wait_full(url, threads):
                loaded.append(_ttft(url, core, f"loaded-{k}", high))
        assert loaded, "the low-priority streams finished before any loaded measurement"
        displaced = _metric(url, "specfleet_num_priority_preemptions_total") - before
        for t in threads:
            t.join(900)
        assert len(undisturbed) == len(disturbed) == NUM_LOW, "a low-priority request was lost"
        run = Run(
            statistics.median(wall for wall, _ in idle),
            statistics.median(wall for wall, _ in loaded),
            statistics.median(cpu for _, cpu in idle),
            statistics.median(cpu for _, cpu in loaded),
            displaced,
            all(disturbed[i] == undisturbed[i] for i in range(NUM_LOW)),
        )
        print(
            f"\npolicy={policy} ttft_idle={[(round(w, 3), round(c, 3)) for w, c in idle]} "
            f"ttft_loaded={[(round(w, 3), round(c, 3)) for w, c in loaded]} (wall s, core CPU s) "
            f"ratio wall={run.loaded_s / run.idle_s:.2f} cpu={run.loaded_cpu_s / run.idle_cpu_s:.2f} "
            f"priority_preemptions={displaced:.0f}"
        )
        return run


def test_a_high_priority_request_keeps_its_ttft_and_no_low_priority_one_is_lost() -> None:
    run = _measure("priority")
    assert run.equal, "a preempted low-priority stream resumed with other tokens than its undisturbed run"
    assert run.displaced >= 1, "the high-priority request got in without displacing a low one"
    assert run.loaded_cpu_s <= 2 * run.idle_cpu_s, (
        f"high-priority TTFT {run.loaded_cpu_s:.3f} s of the core's CPU loaded, {run.idle_cpu_s:.3f} s idle "
        f"(wall {run.loaded_s:.3f} s, {run.idle_s:.3f} s)"
    )


def test_under_fcfs_the_same_request_waits_behind_the_load_and_a_priority_is_a_400() -> None:
    run = _measure("fcfs")
    assert run.equal and run.displaced == 0
    assert run.loaded_cpu_s > 2 * run.idle_cpu_s, (
        f"fcfs: TTFT {run.loaded_cpu_s:.3f} s of the core's CPU loaded, {run.idle_cpu_s:.3f} s idle "
        f"(wall {run.loaded_s:.3f} s, {run.idle_s:.3f} s): the load is not real"
    )


def _check_refusal(url: str) -> None:
    """fcfs takes no priority but 0: a 400 naming the field, in vLLM's words (clients match on them)."""
    body = {"prompt": "Hi", "max_tokens": 2, "priority": 3}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "priority" and "Priority scheduling is not enabled" in error["message"]
    assert "--scheduling-policy priority" in error["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": "high"}
    resp = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority", resp.text
    ok = httpx.post(f"{url}/v1/completions", json={**body, "priority": 0}, timeout=60)
    assert ok.status_code == 200, ok.text
    # and /v1/models says so, which is how the gateway knows to send such a service no priority
    assert httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["scheduling_policy"] == "fcfs"
