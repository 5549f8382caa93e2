"""`specfleet serve --admin-port`: the admin API on its own port (pods: 8001, which their Service does not
expose), the OpenAI API and /metrics on --port only; one server, so SIGTERM drains and exits both."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers import free_port, start_server
from specfleet.engine.python_child import python_command

pytestmark = pytest.mark.slow
TOKEN = "admin-port-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_admin_api_only_on_the_admin_port(tmp_path: Path) -> None:
    pytest.importorskip("specfleet.engine.llm_engine", reason="the engine core is not in the tree yet")
    port, admin_port = free_port(), free_port()
    api, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    log_path = tmp_path / "server.log"
    flags = ("--admin-port", str(admin_port), "--drain-timeout", "5", "--log-level", "warning")
    proc, _ = start_server(log_path, *flags, env={"SPECFLEET_ADMIN_TOKEN": TOKEN}, port=port)
    try:
        on_api = httpx.get(f"{api}/admin/config", headers=AUTH, timeout=10)
        assert on_api.status_code == 404 and on_api.json()["error"]["code"] == "wrong_port"
        assert httpx.get(f"{admin}/admin/config", headers=AUTH, timeout=10).json()["max_num_seqs"] > 0
        assert (
            httpx.get(f"{admin}/admin/config", timeout=10).status_code == 401
        )  # the token is still required
        assert httpx.get(f"{admin}/v1/models", timeout=10).status_code == 404
        assert httpx.get(f"{api}/v1/models", timeout=10).status_code == 200
        assert httpx.get(f"{api}/metrics", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_admin_port_must_differ_from_the_api_port() -> None:
    result = subprocess.run(
        python_command(
            "-m",
            "specfleet.engine",
            "--model",
            "bundled://x",
            "--port",
            "8000",
            "--admin-port",
            "8000",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--admin-port 8000 must differ from --port" in result.stderr
