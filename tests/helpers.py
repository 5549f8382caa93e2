"""Test helpers shared by every test folder (tests/ is on sys.path through the rootdir conftest): free
ports, waiting until something holds or a server answers ready, and stopping a child process."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from specfleet.fleet.supervisor import free_port

__all__ = ["free_port", "stop_process", "wait_for", "wait_http_ready"]


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.2) -> Any:
    """Polls `check` until it returns something truthy (returned), or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_http_ready(
    url: str,
    proc: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
    timeout: float = 180.0,
    interval: float = 0.3,
) -> None:
    """Polls GET `url` until it answers 200; fails at once with the log's tail if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
            raise AssertionError(
                f"{proc.args!r} exited with {proc.returncode} before {url} was ready:\n{tail}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not ready after {timeout}s")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
