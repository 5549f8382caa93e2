"""The cluster side of the tuner's kopf tests, in one place: the objects a test puts into the Kubernetes API
double (tests/fake_kube.py) so that the real kopf timer finds an InferenceService, its admin Secret and its
pods, and the engine's admin API as the tuner reaches it.

The `fake_kube` fixture (tests/tuner/conftest.py) serves the namespace named by the test module's `NS`.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_kube import FakeKube  # tests/ is on sys.path (rootdir conftest)

from .conftest import ADMIN_TOKEN

REPO = Path(__file__).parents[2]
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SERVICE_LABEL = "serving.specfleet.io/inferenceservice"
# The spec the autotuned tests start from: n-gram at k = 3 within [0, 6], the batch limits inside their
# bounds, and a 5 s interval so that a test sees several intervals in well under a minute.
AUTOTUNED_SPEC: dict[str, Any] = {
    "speculative": {"method": "ngram", "numSpeculativeTokens": 3},
    "batching": {"maxNumSeqs": 16, "maxNumBatchedTokens": 512},
    "autotune": {
        "enabled": True,
        "intervalSeconds": 5,
        "bounds": {"numSpeculativeTokens": [0, 6], "maxNumSeqs": [4, 16], "maxNumBatchedTokens": [256, 1024]},
    },
}


def operator_args(ns: str) -> list[str]:
    """`kopf run` of the operator's handlers, watching one namespace (KopfRunner's argv)."""
    return ["run", "--standalone", "--namespace", ns, "-m", "specfleet.operator.handlers"]


def example_service(name: str = "smollm2", **spec: Any) -> dict[str, Any]:
    """examples/smollm2-cpu.yaml named `name`, with `spec`'s top-level fields replaced."""
    doc = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(copy.deepcopy(spec))
    return doc


def put_service(kube: FakeKube, ns: str, doc: dict[str, Any]) -> None:
    """The InferenceService and the admin Secret the operator would have made for it."""
    kube.put(*ISVC, ns, doc)
    token = base64.b64encode(ADMIN_TOKEN.encode()).decode()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": f"{doc['metadata']['name']}-admin", "namespace": ns},
        "data": {"token": token},
    }
    kube.put("/api/v1", "secrets", ns, secret)


def put_pod(
    kube: FakeKube, ns: str, name: str, labels: dict[str, str], ip: str, *, ready: bool
) -> dict[str, Any]:
    """A pod as the kubelet reports it (IP and Ready condition); returned so a test can flip it."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }
    kube.put("/api/v1", "pods", ns, pod)
    return pod


def aim_tuner_at(engine_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make the tuner reach pods on the test engine's port (pods listen on 8000 and serve their admin API
    on 8001; the test engine answers both on one free port); returns the engine's host, the pod IP."""
    from specfleet.tuner import handlers as tuner_handlers

    host, port = engine_url.removeprefix("http://").split(":")
    monkeypatch.setattr(tuner_handlers, "ENGINE_PORT", int(port))
    monkeypatch.setattr(tuner_handlers, "ADMIN_PORT", int(port))
    return host


def engine_config(url: str) -> dict[str, int]:
    """The live config the engine runs (its admin API)."""
    return httpx.get(f"{url}/admin/config", headers=AUTH, timeout=10).json()


def engine_set(url: str, **values: int) -> None:
    """Set live knobs by hand, as an SRE or a restarted pod's command line would."""
    httpx.patch(f"{url}/admin/config", json=values, headers=AUTH, timeout=10).raise_for_status()
