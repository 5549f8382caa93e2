"""The tuner as the operator runs it: the real kopf timer under KopfRunner, the Kubernetes API faked at its
edge (tests/fake_kube.py, an HTTP server), one real engine process as the service's ready pod.

It checks the operator-side wiring the policy tests cannot: the timer builds the service's tuner from the
spec and the admin Secret, finds the ready pod, pushes the spec's config to it through the admin API,
pushes it again after the pod lost it (as a restarted pod does), and writes `status.tuning` and the
`Tuned` condition, never `spec`.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_kube import FakeKube, Rbac  # tests/ is on sys.path (rootdir conftest)
from helpers import wait_for

from .conftest import ADMIN_TOKEN

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
NS = "team-t"
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def fake_kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    server = FakeKube(rbac=Rbac.from_chart({"watch": {"namespaces": [NS]}})).start()  # the chart's RBAC, enforced
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", NS)))
    server.add_namespace(NS)
    yield server
    server.stop()


def engine_config(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/admin/config", headers=AUTH, timeout=10).json()


def test_kopf_timer_pushes_the_config_to_ready_pods_and_reports_in_status(
        engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    from kopf.testing import KopfRunner
    from specfleet.tuner import handlers as tuner_handlers

    host, port = engine_url.removeprefix("http://").split(":")
    monkeypatch.setattr(tuner_handlers, "ENGINE_PORT", int(port))  # pods listen on 8000; this one elsewhere
    monkeypatch.setattr(tuner_handlers, "ADMIN_PORT", int(port))  # ... and serves its admin API beside it
    assert engine_config(engine_url)["num_speculative_tokens"] == 0

    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["spec"]["speculative"] = {"method": "ngram", "numSpeculativeTokens": 3}
    doc["spec"]["batching"] = {"maxNumSeqs": 16, "maxNumBatchedTokens": 512}
    doc["spec"]["autotune"] = {"enabled": True, "intervalSeconds": 5,
                               "bounds": {"numSpeculativeTokens": [0, 6], "maxNumSeqs": [4, 16],
                                          "maxNumBatchedTokens": [256, 1024]}}
    fake_kube.put(*ISVC, NS, doc)
    token = base64.b64encode(ADMIN_TOKEN.encode()).decode()
    fake_kube.put("/api/v1", "secrets", NS, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                              "metadata": {"name": "smollm2-admin", "namespace": NS},
                                              "data": {"token": token}})
    fake_kube.put("/api/v1", "pods", NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "smollm2-0", "namespace": NS, "labels": {"serving.specfleet.io/inferenceservice": "smollm2"}},
        "status": {"podIP": host, "conditions": [{"type": "Ready", "status": "True"}]},
    })

    def tuning() -> dict[str, Any]:
        return ((fake_kube.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("tuning") or {}

    args = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]
    with KopfRunner(args, timeout=120) as runner:
        wait_for("the spec's k pushed to the ready pod", lambda: engine_config(engine_url)["num_speculative_tokens"] == 3,
                 timeout=60)
        status = wait_for("status.tuning", tuning, timeout=60)
        # a pod that restarts comes back with its command-line config; the next interval fixes it
        httpx.patch(f"{engine_url}/admin/config", json={"num_speculative_tokens": 0}, headers=AUTH,
                    timeout=10).raise_for_status()
        wait_for("the config pushed again", lambda: engine_config(engine_url)["num_speculative_tokens"] == 3,
                 timeout=60)

    assert runner.exception is None, runner.output
    assert not fake_kube.answered(403), [(r.method, r.path) for r in fake_kube.answered(403)]
    assert status.get("reason"), status  # every interval says why it holds or changes
    isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
    conditions = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions", [])}
    assert "Tuned" in conditions and conditions["Tuned"].get("reason"), conditions
    assert isvc["spec"]["speculative"]["numSpeculativeTokens"] == 3  # spec is the user's: never written
    writes = [r for r in fake_kube.requests if r.method in ("PUT", "PATCH") and "/inferenceservices/" in r.path]
    assert writes and all(r.path.endswith("/status") or "spec" not in (r.body or {}) for r in writes
                          if isinstance(r.body, dict))
