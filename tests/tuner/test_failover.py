"""Two operator replicas as the chart runs them (`python -m specfleet.operator.cli --leader-elect`, real
processes) against the API double, one real engine as the service's ready pod: one replica leads and tunes,
the standby runs no handler; the leader is killed (SIGKILL: no goodbye, the Lease simply stops being
renewed) and the standby takes over within 15 s, its tuner continuing from `status.tuning.resume`; then a
clean stop (SIGTERM, as in a rolling update) hands the Lease to a fresh replica within seconds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from fake_kube import FakeKube  # tests/ is on sys.path (rootdir conftest)
from helpers import free_port, wait_for
from specfleet.engine.python_child import python_command
from specfleet.operator import load_inference_service

from .cluster import (
    AUTOTUNED_SPEC,
    ISVC,
    SERVICE_LABEL,
    engine_config,
    engine_set,
    example_service,
    put_pod,
    put_service,
)

pytestmark = pytest.mark.slow

NS = "team-f"
LEASE_NS = "specfleet-system"  # the release namespace: where the chart grants the operator its Lease
LEASE = ("/apis/coordination.k8s.io/v1", "leases", LEASE_NS, "specfleet-operator")
# The CLI as the image runs it, with the tuner aimed at the test engine's one port (pods serve the API on
# 8000 and the admin API on 8001; the test engine answers both on one port), as tests/tuner/cluster.py's
# aim_tuner_at does in process.
RUN = """import sys
from specfleet.tuner import handlers
handlers.ENGINE_PORT = handlers.ADMIN_PORT = int(sys.argv[1])
from specfleet.operator.cli import main
sys.exit(main(sys.argv[2:]))
"""
FAILOVER_BUDGET_S = 15.0  # issue 34: the standby takes over within 15 s
RESUME_AFTER_LEASE_S = 4.0  # measured 1.3-1.8 s with the 1 s first tick, 5.1-5.2 s with the 5 s one


class Replica:
    def __init__(self, name: str, engine_url: str, tmp: Path) -> None:
        self.name, self.log_path = name, tmp / f"operator-{name}.log"
        self.health = free_port()
        port = engine_url.rsplit(":", 1)[1]
        args = ["--namespace", NS, "--standalone", "--leader-elect", "--liveness-port", str(self.health)]
        env = {**os.environ, "POD_NAMESPACE": LEASE_NS, "PYTHONUNBUFFERED": "1"}
        self.log: IO[bytes] = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            python_command("-c", RUN, port, *args), stdout=self.log, stderr=subprocess.STDOUT, env=env
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def identity(self) -> str | None:
        found = re.search(r"event=leader_election_wait identity=(\S+)", self.text())
        return found.group(1) if found else None

    def healthz(self) -> Any:
        try:
            return httpx.get(f"http://127.0.0.1:{self.health}/healthz", timeout=2).json()
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()


def holder(fake: FakeKube) -> str:
    return ((fake.get(*LEASE) or {}).get("spec") or {}).get("holderIdentity") or ""


def test_the_standby_takes_over_a_killed_leader_and_resumes_tuning(
    engine_url: str, fake_kube: FakeKube, tmp_path: Path
) -> None:
    from specfleet.tuner.loop import tuner_fingerprint

    host = engine_url.removeprefix("http://").split(":")[0]
    doc = example_service("smollm2", **AUTOTUNED_SPEC)
    put_service(fake_kube, NS, doc)
    put_pod(fake_kube, NS, "smollm2-0", {SERVICE_LABEL: "smollm2"}, host, ready=True)
    shell = {
        "apiVersion": ISVC[0].removeprefix("/apis/"),
        "kind": "InferenceService",
        "metadata": doc["metadata"],
    }
    fingerprint = tuner_fingerprint(load_inference_service({**shell, "spec": doc["spec"]}).spec)
    learned = [[1.0, 0.0, 0.02], [4.0, 0.0, 0.03], [8.0, 0.0, 0.05]]
    resume = {"specHash": fingerprint, "costPoints": learned, "plainCostPoints": learned}
    previous = {"numSpeculativeTokens": 5, "maxNumSeqs": 16, "maxNumBatchedTokens": 512, "resume": resume}
    isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
    fake_kube.put(*ISVC, NS, {**isvc, "status": {"tuning": previous}})  # a previous operator's k = 5
    engine_set(engine_url, num_speculative_tokens=0)

    replicas = [Replica("a", engine_url, tmp_path), Replica("b", engine_url, tmp_path)]
    try:
        wait_for("both replicas to stand as candidates", lambda: all(r.identity() for r in replicas), 60)
        wait_for("a leader", lambda: holder(fake_kube), 30)
        (leader,) = [r for r in replicas if r.identity() == holder(fake_kube)]
        (standby,) = [r for r in replicas if r is not leader]
        wait_for(
            "the leader's tuner to resume k = 5",
            lambda: engine_config(engine_url)["num_speculative_tokens"] == 5,
            60,
        )
        assert standby.healthz() == {"leader": False}  # alive and ready for its probes, leading nothing
        assert "Handler '" not in standby.text() and "event=tuner_resumed" not in standby.text()

        seen = len(fake_kube.requests)
        killed = time.monotonic()
        leader.proc.send_signal(signal.SIGKILL)
        engine_set(engine_url, num_speculative_tokens=0)  # what a restarted pod comes back with

        def first_status_write() -> bool:
            return any(
                r.method == "PATCH" and r.path.endswith("/smollm2/status") and r.status == 200
                for r in fake_kube.requests[seen:]
            )

        wait_for("the standby to hold the Lease", lambda: holder(fake_kube) == standby.identity(), 30)
        took_lease = time.monotonic() - killed
        wait_for("the new leader's first status write", first_status_write, 30, 0.05)
        took_over = time.monotonic() - killed
        wait_for(
            "the new leader's tuner to push the resumed k = 5",
            lambda: engine_config(engine_url)["num_speculative_tokens"] == 5,
            60,
        )
        tuned = time.monotonic() - killed
        print(
            f"failover after SIGKILL: lease {took_lease:.1f} s, first write {took_over:.1f} s, k pushed {tuned:.1f} s"
        )
        assert took_over <= FAILOVER_BUDGET_S, took_over
        assert tuned <= FAILOVER_BUDGET_S, f"the tuner resumed {tuned:.1f} s after the leader's SIGKILL"
        # kopf's start (about 1 s) plus the tuner's first tick (1 s): under one whole 5 s tick, which the
        # first tick used to wait (then 5.1-5.2 s here between the Lease and the push)
        assert tuned - took_lease <= RESUME_AFTER_LEASE_S, (
            f"the tuner resumed {tuned - took_lease:.1f} s after the Lease"
        )
        assert "event=tuner_resumed" in standby.text(), standby.text()[-3000:]

        # a rolling update: a new replica stands by, the leader gets SIGTERM and hands the Lease over
        fresh = Replica("c", engine_url, tmp_path)
        replicas.append(fresh)
        wait_for("the new candidate", lambda: fresh.identity() and fresh.healthz() == {"leader": False}, 60)
        stopped = time.monotonic()
        standby.proc.send_signal(signal.SIGTERM)
        assert standby.proc.wait(timeout=30) == 0, standby.text()[-3000:]
        wait_for(
            "the new candidate to hold the Lease", lambda: holder(fake_kube) == fresh.identity(), 15, 0.05
        )
        handed_over = time.monotonic() - stopped
        print(f"hand-over after SIGTERM: {handed_over:.1f} s")
        assert "event=lease_released" in standby.text()
    finally:
        for replica in replicas:
            replica.stop()
    assert not fake_kube.answered(403), [(r.method, r.path) for r in fake_kube.answered(403)]
    assert not (fake_kube.get(*ISVC, NS, "smollm2") or {})["metadata"].get("finalizers")
