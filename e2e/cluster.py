"""Helpers the e2e suite shares: the namespace, the release name and kubectl."""

from __future__ import annotations

import os
import shutil
import subprocess

NAMESPACE = os.environ.get("SPECFLEET_E2E_NAMESPACE", "specfleet-e2e")
RELEASE = "specfleet-e2e"


def cluster_problem() -> str | None:
    """Why the e2e suite cannot run here, or None when a cluster answers."""
    for tool in ("kubectl", "helm"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    try:
        probe = subprocess.run(
            ["kubectl", "version", "--request-timeout=5s", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "the Kubernetes API did not answer within 15 s"
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or ["kubectl version failed"]
        return f"no reachable Kubernetes cluster ({lines[-1]})"
    return None


def kubectl(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result
