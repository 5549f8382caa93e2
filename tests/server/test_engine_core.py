"""The engine core in its own process: a core killed with SIGKILL takes the server's readiness down with
one clear log line, fails what was in flight, and the server exits non-zero so that the pod restarts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "specfleet.engine",
        "serve",
        "--model",
        "bundled://smollm2-135m-instruct",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--kv-cache-gib",
        "0.1",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "server did not become ready"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        time.sleep(0.3)


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
        result: dict[str, Any] = {}
        started = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST",
                    f"{url}/v1/completions",
                    timeout=60,
                    json={"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "stream": True, "ignore_eos": True},
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
    # The stream that was running did not end as if it had finished: an error chunk, or a cut connection.
    lines = result.get("lines", [])
    assert not any('"finish_reason":"length"' in line for line in lines), lines[-3:]
    assert "error" in result or any('"error"' in line for line in lines), result


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
