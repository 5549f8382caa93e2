"""What `kubectl describe isvc` shows of the tuner, and the incident switch, as the operator runs them: the
real kopf timer under KopfRunner, the Kubernetes API faked at its edge (tests/fake_kube.py, an HTTP server
that records the Events posted), one real engine process as the service's pod.

Sequence: no ready pod (nothing runs: Tuned=True/Idle, not failing static), a ready pod whose /metrics
nobody answers (metrics missing: TuningStatic, a Warning), the pod reachable (TuningRecovered),
`kubectl annotate ... specfleet.io/tuner-freeze=true` (TuningFrozen, status.tuning.frozenBy, Tuned=False
Frozen; a config set by hand on the engine stays), the annotation removed (TuningResumed, the tuner's
config pushed again). The fake runs no controllers and does not model Event aggregation (each post is one
request); kopf posts Events itself.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from fake_kube import FakeKube  # tests/ is on sys.path (rootdir conftest)
from helpers import wait_for

from .cluster import (
    AUTH,
    AUTOTUNED_SPEC,
    ISVC,
    SERVICE_LABEL,
    aim_tuner_at,
    engine_config,
    example_service,
    operator_args,
    put_pod,
    put_service,
)

pytestmark = pytest.mark.slow

NS = "team-f"


def k(url: str) -> int:
    return engine_config(url)["num_speculative_tokens"]


def test_describe_shows_static_recovered_frozen_resumed_and_the_freeze_holds(
    engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kopf.testing import KopfRunner

    host = aim_tuner_at(engine_url, monkeypatch)
    put_service(fake_kube, NS, example_service("frz", **AUTOTUNED_SPEC))
    # 127.0.0.2: no engine listens there (the test engine binds 127.0.0.1), as a ready pod the operator
    # cannot scrape (a NetworkPolicy, a wrong port)
    pod = put_pod(fake_kube, NS, "frz-0", {SERVICE_LABEL: "frz"}, "127.0.0.2", ready=False)

    def events() -> list[tuple[str, str, str]]:
        return [
            (e.get("type", ""), e.get("reason", ""), e.get("message", ""))
            for r in fake_kube.requests
            if r.method == "POST"
            and r.path.endswith("/events")
            and isinstance(e := r.body, dict)
            and (e.get("involvedObject") or {}).get("name") == "frz"
        ]

    def reasons() -> list[str]:
        return [reason for _, reason, _ in events() if reason.startswith("Tuning")]

    def isvc() -> dict[str, Any]:
        return fake_kube.get(*ISVC, NS, "frz") or {}

    def tuned() -> dict[str, Any]:
        return {c["type"]: c for c in (isvc().get("status") or {}).get("conditions", [])}.get("Tuned", {})

    def annotate(value: str | None) -> None:
        obj = isvc()
        annotations = obj["metadata"].setdefault("annotations", {})
        if value is None:
            annotations.pop("specfleet.io/tuner-freeze", None)
        else:
            annotations["specfleet.io/tuner-freeze"] = value
        fake_kube.put(*ISVC, NS, obj)

    with KopfRunner(operator_args(NS), timeout=150) as runner:
        wait_for("Tuned=True/Idle while no pod is ready", lambda: tuned().get("reason") == "Idle", timeout=40)
        assert "no engine is ready" in tuned()["message"] and "TuningStatic" not in reasons()
        pod["status"]["conditions"][0]["status"] = "True"
        fake_kube.put("/api/v1", "pods", NS, pod)
        wait_for(
            "TuningStatic while the ready pod is unreachable", lambda: "TuningStatic" in reasons(), timeout=40
        )
        # the pod answers nothing, so the push of the config in force fails too: ApplyFailed outranks it
        wait_for(
            "Tuned=False (MetricsUnavailable or ApplyFailed)",
            lambda: (
                (tuned().get("status"), tuned().get("reason"))
                in {("False", "MetricsUnavailable"), ("False", "ApplyFailed")}
            ),
        )
        pod["status"]["podIP"] = host
        fake_kube.put("/api/v1", "pods", NS, pod)
        wait_for(
            "TuningRecovered once the pod is reachable", lambda: "TuningRecovered" in reasons(), timeout=40
        )
        wait_for("the tuner's config pushed", lambda: k(engine_url) == 3, timeout=30)

        annotate("true")
        wait_for("TuningFrozen", lambda: "TuningFrozen" in reasons(), timeout=30)
        wait_for(
            "Tuned=False/Frozen",
            lambda: (tuned().get("status"), tuned().get("reason")) == ("False", "Frozen"),
        )
        assert isvc()["status"]["tuning"]["frozenBy"] == "annotation specfleet.io/tuner-freeze=true"
        httpx.patch(
            f"{engine_url}/admin/config", json={"num_speculative_tokens": 1}, headers=AUTH, timeout=10
        ).raise_for_status()  # an SRE sets k by hand during the incident
        # the next frozen interval reports what the engine runs; two more intervals push nothing over it
        wait_for(
            "status showing the hand-set k",
            lambda: isvc()["status"]["tuning"]["numSpeculativeTokens"] == 1,
            timeout=30,
        )
        time.sleep(
            2 * 5 + 1
        )  # intervalSeconds 5 (the reconcile also writes status, so count time, not writes)
        assert k(engine_url) == 1, "the frozen tuner pushed its config over the hand-set one"
        assert isvc()["status"]["tuning"]["numSpeculativeTokens"] == 1

        annotate(None)
        wait_for("TuningResumed", lambda: "TuningResumed" in reasons(), timeout=30)
        wait_for("the tuner's config pushed again", lambda: k(engine_url) == 3, timeout=30)
        assert "frozenBy" not in isvc()["status"]["tuning"]  # the null in the merge patch removed it

    assert runner.exception is None, runner.output
    order = [
        r for r in reasons() if r in ("TuningStatic", "TuningRecovered", "TuningFrozen", "TuningResumed")
    ]
    assert order == ["TuningStatic", "TuningRecovered", "TuningFrozen", "TuningResumed"], events()
    kinds = {reason: kind for kind, reason, _ in events()}
    assert kinds["TuningStatic"] == "Warning" and kinds["TuningFrozen"] == "Normal"
    static_message = next(m for _, r, m in events() if r == "TuningStatic")
    assert "fail static" in static_message and "answered /metrics" in static_message
