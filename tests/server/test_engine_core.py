"""The engine core in its own process: a core killed with SIGKILL takes the server's readiness down with
one clear log line, fails what was in flight, and the server exits non-zero so that the pod restarts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import start_server
from specfleet.engine.python_child import python_command


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    log_path = tmp_path / "server.log"
    proc, url = start_server(log_path)
    return proc, url, log_path


@pytest.mark.slow
def test_sigkill_of_the_core_fails_in_flight_requests_and_exits_non_zero(tmp_path: Path) -> None:
    proc, url, log_path = _start(tmp_path)
    try:
        match = re.search(r"event=engine_core_ready pid=(\d+)", log_path.read_text())
        assert match, log_path.read_text()[-2000:]
        core_pid = int(match.group(1))
        assert core_pid != proc.pid
        ok = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=60
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        result, started, thread = _stream_in_background(url, "Count: 1, 2, 3,")
        assert started.wait(60)
        os.kill(core_pid, signal.SIGKILL)
        code = proc.wait(30)
        thread.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert code != 0, log_text[-3000:]
    assert re.search(
        rf"event=engine_core_dead the engine core \(pid {core_pid}\) exited: killed by SIGKILL", log_text
    )
    assert "event=exit reason=engine_core_dead exit_code=1" in log_text
    _assert_failed_midway(result)


def _stream_in_background(url: str, prompt: str) -> tuple[dict[str, Any], threading.Event, threading.Thread]:
    """A long streaming completion in a thread: (its result, set at the first chunk, the thread)."""
    result: dict[str, Any] = {}
    started = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                timeout=60,
                json={"prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True},
            ) as resp:
                result["status"] = resp.status_code
                result["lines"] = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        result["lines"].append(line[6:])
                        started.set()
        except Exception as exc:  # the server may go away mid-stream: recorded, asserted below
            result["error"] = repr(exc)
        started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    return result, started, thread


def _assert_failed_midway(result: dict[str, Any]) -> None:
    """The stream that was running did not end as if it had finished: an error chunk, or a cut connection."""
    lines = result.get("lines", [])
    assert not any('"finish_reason":"length"' in line for line in lines), lines[-3:]
    assert "error" in result or any('"error"' in line for line in lines), result


def test_sigkill_of_a_tensor_parallel_worker_takes_the_served_engine_down(
    tmp_path: Path, tiny_llama: str
) -> None:
    # TP=2 on the tiny random llama over gloo: rank 1 is a process the core spawned. Its death fails the
    # core's next collective; the core exits naming the rank and its exit code, and the server takes the
    # core-death path: in-flight requests fail, readiness down, exit 1.
    log_path = tmp_path / "server.log"
    args = (
        "--model",
        tiny_llama,
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "512",
        "--kv-cache-gib",
        "0.02",
    )
    proc, url = start_server(log_path, *args)
    try:
        match = re.search(r"event=split_model_ready tp=2 .* workers=rank1:pid(\d+)", log_path.read_text())
        assert match, log_path.read_text()[-2000:]
        result, started, thread = _stream_in_background(url, "Count: 1, 2, 3,")
        assert started.wait(60) and result.get("lines"), result
        os.kill(int(match.group(1)), signal.SIGKILL)
        code = proc.wait(60)
        thread.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert code == 1, log_text[-3000:]
    assert re.search(
        r"event=engine_worker_died tensor-parallel worker failure: rank 1 exited with code -9 \(.*\); "
        r"the engine core exits",
        log_text,
    ), log_text[-3000:]
    assert re.search(r"event=engine_core_dead .*; failing 1 in-flight requests, readiness down", log_text)
    assert "event=exit reason=engine_core_dead exit_code=1" in log_text
    _assert_failed_midway(result)


def test_ready_and_new_requests_answer_503_once_the_core_is_dead(serve_app: Any) -> None:
    """The app alone (no exit hook): after the core's death /ready says why and new work gets 503."""
    from specfleet.engine import EngineConfig
    from specfleet.engine.core.client import EngineCoreClient
    from specfleet.engine.server.app import build_state, create_app

    client = EngineCoreClient(
        EngineConfig(model="bundled://smollm2-135m-instruct", max_model_len=256, kv_cache_gib=0.05),
        log_level="warning",
    )
    deaths: list[str] = []
    client.on_dead.append(deaths.append)
    uv, thread, url = serve_app(create_app(build_state(client, admin_token="t")))
    try:
        assert httpx.get(f"{url}/ready", timeout=5).json() == {"ready": True, "model": client.info.model_name}
        os.kill(client.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (resp := httpx.get(f"{url}/ready", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "/ready stayed 200 after the core died"
            time.sleep(0.05)
        assert resp.status_code == 503 and resp.json() == {"ready": False, "reason": "engine_core_dead"}
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
        assert "killed by SIGKILL" in late.json()["error"]["message"]
        assert len(deaths) == 1 and f"pid {client.pid}" in deaths[0]
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # the process itself is alive
    finally:
        uv.should_exit = True
        thread.join(15)
        client.stop()


def _loaded_after(imports: list[str], heavy: tuple[str, ...]) -> list[str]:
    """Which of the `heavy` modules a fresh interpreter has loaded after importing `imports`."""

    probe = f"import sys, {', '.join(imports)}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run(python_command("-c", probe), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return [m for m in done.stdout.strip().split(",") if m]


def test_the_api_server_process_spawns_the_core_before_importing_torch() -> None:
    """What the server process imports before it spawns the core: no torch, no grammar compiler (the
    structured-output backend), no transformers. Those took ~3.7 s of every server's start before the core
    was even spawned; the core imports what it needs itself, and the server loads its tokenizer while the
    core loads the model."""
    server = ["specfleet.engine.server.cli", "specfleet.engine.server.app", "specfleet.engine.core.client"]
    assert _loaded_after(server, ("torch", "xgrammar", "transformers")) == []


def test_the_engine_loads_the_grammar_compiler_only_for_a_structured_request() -> None:
    """The engine core's modules do not import xgrammar: an engine that never serves a structured request
    does not pay its import (~0.7 s of a cold start on one core, more with transformers not yet loaded)."""
    core = ["specfleet.engine.llm_engine", "specfleet.engine.model_runner", "specfleet.engine.core.proc"]
    assert _loaded_after(core, ("torch", "xgrammar")) == ["torch"]  # torch: the probe can tell
