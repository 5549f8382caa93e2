"""The tuner as the operator runs it: the real kopf timer under KopfRunner, the Kubernetes API faked at its
edge (tests/fake_kube.py, an HTTP server), one real engine process as the service's ready pod.

It checks the operator-side wiring the policy tests cannot: the timer builds the service's tuner from the
spec and the admin Secret, finds the ready pod, pushes the spec's config to it through the admin API,
pushes it again after the pod lost it (as a restarted pod does), writes the config the pod accepted into
the `NAME-tuned` ConfigMap under the file name the Deployment's pods start on, and writes `status.tuning`
and the `Tuned` condition, never `spec`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fake_kube import FakeKube  # tests/ is on sys.path (rootdir conftest)
from helpers import wait_for
from specfleet.engine.knobs import camel

from .cluster import (
    AUTH,
    AUTOTUNED_SPEC,
    ISVC,
    SERVICE_LABEL,
    aim_tuner_at,
    engine_config,
    engine_set,
    example_service,
    operator_args,
    put_pod,
    put_service,
)
from .conftest import ADMIN_TOKEN

pytestmark = pytest.mark.slow

NS = "team-t"


def _autotuned_service(
    engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """An autotuned smollm2 (spec k = 3) whose one ready pod is the engine at `engine_url`, and its admin
    Secret; returns the InferenceService."""
    host = aim_tuner_at(engine_url, monkeypatch)
    doc = example_service("smollm2", **AUTOTUNED_SPEC)
    put_service(fake_kube, NS, doc)
    put_pod(fake_kube, NS, "smollm2-0", {SERVICE_LABEL: "smollm2"}, host, ready=True)
    return doc


def test_kopf_timer_pushes_the_config_to_ready_pods_and_reports_in_status(
    engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kopf.testing import KopfRunner
    from specfleet.operator import load_inference_service
    from specfleet.operator.render.deployment import live_config_file

    doc = _autotuned_service(engine_url, fake_kube, monkeypatch)
    engine_set(engine_url, num_speculative_tokens=0)

    def tuning() -> dict[str, Any]:
        return ((fake_kube.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("tuning") or {}

    with KopfRunner(operator_args(NS), timeout=120) as runner:
        wait_for(
            "the spec's k pushed to the ready pod",
            lambda: engine_config(engine_url)["num_speculative_tokens"] == 3,
            timeout=60,
        )
        status = wait_for("status.tuning", tuning, timeout=60)
        configmap = wait_for(
            "the tuned ConfigMap",
            lambda: fake_kube.get("/api/v1", "configmaps", NS, "smollm2-tuned"),
            timeout=30,
        )
        # a pod that restarts comes back with its command-line config; the next interval fixes it
        httpx.patch(
            f"{engine_url}/admin/config", json={"num_speculative_tokens": 0}, headers=AUTH, timeout=10
        ).raise_for_status()
        wait_for(
            "the config pushed again",
            lambda: engine_config(engine_url)["num_speculative_tokens"] == 3,
            timeout=60,
        )

    assert runner.exception is None, runner.output
    assert not fake_kube.answered(403), [(r.method, r.path) for r in fake_kube.answered(403)]
    assert status.get("reason"), status  # every interval says why it holds or changes
    # what a new pod starts on: the config the ready pod accepted, in the file its template names
    # (tests/operator/test_op_render.py: the template's --live-config-file is this spec's key)
    started_on = live_config_file(load_inference_service({**_isvc_shell(), "spec": doc["spec"]}).spec)
    values = json.loads(configmap["data"][started_on])
    assert values["num_speculative_tokens"] == 3 and {"max_num_seqs", "max_num_batched_tokens"} <= set(values)
    assert values == {name: status[camel(name)] for name in values}, (values, status)
    assert configmap["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
    conditions = {c["type"]: c for c in (isvc.get("status") or {}).get("conditions", [])}
    assert "Tuned" in conditions and conditions["Tuned"].get("reason"), conditions
    assert isvc["spec"]["speculative"]["numSpeculativeTokens"] == 3  # spec is the user's: never written
    writes = [
        r for r in fake_kube.requests if r.method in ("PUT", "PATCH") and "/inferenceservices/" in r.path
    ]
    assert writes and all(
        r.path.endswith("/status") or "spec" not in (r.body or {}) for r in writes if isinstance(r.body, dict)
    )


def test_a_restarted_operator_resumes_and_scaling_keeps_the_tuned_config(
    engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status.tuning from a previous operator (k = 5, learned step costs) is where a new one continues; a
    /scale write (generation bump) keeps it; a change of a field the tuner depends on (the SLO) rebuilds the
    policy from the spec (k = 3)."""
    from kopf.testing import KopfRunner
    from specfleet.operator import load_inference_service
    from specfleet.tuner.loop import tuner_fingerprint

    engine_set(engine_url, num_speculative_tokens=0)
    spec = _autotuned_service(engine_url, fake_kube, monkeypatch)["spec"]
    fingerprint = tuner_fingerprint(load_inference_service({**_isvc_shell(), "spec": spec}).spec)
    learned = [[1.0, 0.0, 0.02], [4.0, 0.0, 0.03], [8.0, 0.0, 0.05]]
    previous = {
        "tuning": {
            "numSpeculativeTokens": 5,
            "maxNumSeqs": 16,
            "maxNumBatchedTokens": 512,
            "resume": {
                "specHash": fingerprint,
                "costPoints": learned,
                "plainCostPoints": learned,
                "acceptance": [{"demand": 1.0, "perPos": [0.9, 0.8], "share": 1.0, "ageSeconds": 10.0}],
            },
        }
    }
    isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
    fake_kube.put(*ISVC, NS, {**isvc, "status": previous})

    def status_writes() -> int:
        return sum(
            1
            for r in fake_kube.requests
            if r.method == "PATCH"
            and "/inferenceservices/" in r.path
            and isinstance(r.body, dict)
            and "tuning" in (r.body.get("status") or {})
        )

    with KopfRunner(operator_args(NS), timeout=150) as runner:
        wait_for(
            "the resumed k pushed",
            lambda: engine_config(engine_url)["num_speculative_tokens"] == 5,
            timeout=60,
        )
        isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
        generation = isvc["metadata"]["generation"]
        isvc["spec"]["replicas"] = 2  # what `kubectl scale isvc/smollm2 --replicas=2` writes
        fake_kube.put(*ISVC, NS, isvc)
        assert (fake_kube.get(*ISVC, NS, "smollm2") or {})["metadata"]["generation"] == generation + 1
        seen = status_writes()
        wait_for("two tuner intervals after the scale", lambda: status_writes() >= seen + 2, timeout=60)
        after_scale = engine_config(engine_url)["num_speculative_tokens"]
        resume = (
            ((fake_kube.get(*ISVC, NS, "smollm2") or {}).get("status") or {})
            .get("tuning", {})
            .get("resume", {})
        )
        isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
        isvc["spec"]["slo"] = {"ttftP95Ms": 900, "tpotP95Ms": 80}
        fake_kube.put(*ISVC, NS, isvc)
        wait_for(
            "the spec's k after an SLO change",
            lambda: engine_config(engine_url)["num_speculative_tokens"] == 3,
            timeout=60,
        )

    assert runner.exception is None, runner.output
    assert after_scale == 5, "scaling reset the tuner to the spec's config"
    assert resume.get("specHash") == fingerprint and resume.get("costPoints", [])[:3] == learned, resume


def test_a_kubectl_scale_keeps_the_replica_policys_cooldown(
    engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica knob remembers its last change across a `/scale` write (a spec change that leaves its
    settings alone): an idle service at 3 replicas scales down to 2 at once (no stabilization window), then
    holds in the cooldown although `kubectl scale` bumped the generation in between; a policy rebuilt by
    that write would have no last change and scale down to 1 at its next interval. A change of the knob's
    own settings (`spec.autoscaling`) does take effect."""
    from kopf.testing import KopfRunner

    aim_tuner_at(engine_url, monkeypatch)
    host = engine_url.removeprefix("http://").split(":")[0]
    doc = example_service(
        "smollm2",
        **AUTOTUNED_SPEC,
        # a cooldown far longer than the test (about 30 s), so that only a forgotten last change ends it
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 3,
            "scaleDownStabilizationSeconds": 0,
            "cooldownSeconds": 600,
        },
    )
    put_service(fake_kube, NS, doc)
    put_pod(fake_kube, NS, "smollm2-0", {SERVICE_LABEL: "smollm2"}, host, ready=True)
    isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
    # a previous operator's count: three replicas, the one pod here idle
    fake_kube.put(*ISVC, NS, {**isvc, "status": {"autoscaling": {"replicas": 3, "reason": "earlier"}}})

    def autoscaling() -> dict[str, Any]:
        return ((fake_kube.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("autoscaling") or {}

    def decisions() -> int:
        return sum(
            1
            for r in fake_kube.requests
            if r.method == "PATCH"
            and r.path.endswith("/status")
            and isinstance(r.body, dict)
            and "autoscaling" in (r.body.get("status") or {})
        )

    with KopfRunner(operator_args(NS), timeout=150) as runner:
        down = wait_for(
            "the idle service scaled down to 2",
            lambda: autoscaling().get("replicas") == 2 and autoscaling(),
            timeout=60,
        )
        isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
        isvc["spec"]["replicas"] = 2  # what `kubectl scale isvc/smollm2 --replicas=2` writes
        fake_kube.put(*ISVC, NS, isvc)
        seen = decisions()
        wait_for("two replica decisions after the scale", lambda: decisions() >= seen + 2, timeout=60)
        after = autoscaling()
        # a change of the knob's own settings does rebuild it: no cooldown now, so down to the floor
        isvc = fake_kube.get(*ISVC, NS, "smollm2") or {}
        isvc["spec"]["autoscaling"]["cooldownSeconds"] = 0
        fake_kube.put(*ISVC, NS, isvc)
        wait_for(
            "the floor after the cooldown's change", lambda: autoscaling().get("replicas") == 1, timeout=60
        )

    assert runner.exception is None, runner.output
    assert down["reason"].startswith("scale-down 3 -> 2: idle"), down
    assert after.get("replicas") == 2 and "cooldown" in after.get("reason", ""), after


def _isvc_shell() -> dict[str, Any]:
    return {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smollm2", "namespace": NS},
    }


def test_between_intervals_only_pods_not_yet_configured_get_the_config(engine_url: str) -> None:
    """A pod of a scale-up is brought to the config in force at the next timer tick (5 s), not at the next
    interval; pods already configured are not asked again. The same engine answers on 127.0.0.1 and on
    localhost: two pods as the tuner sees them."""
    import asyncio

    from specfleet.tuner.actuator import AdminActuator
    from specfleet.tuner.loop import ServiceTuner
    from specfleet.tuner.policy import Policy
    from specfleet.tuner.types import TunedConfig

    from .test_policy import PARAMS

    first, second = engine_url, engine_url.replace("127.0.0.1", "localhost")
    ready = [first]

    async def endpoints() -> list[str]:
        return list(ready)

    async def scenario() -> list[int]:
        tuner = ServiceTuner(
            "t/x",
            Policy(PARAMS, TunedConfig(5, 16, 512)),
            None,
            AdminActuator(ADMIN_TOKEN),
            endpoints,
        )
        try:
            seen = []
            await tuner.sync_new_pods()
            seen.append(engine_config(engine_url)["num_speculative_tokens"])
            engine_set(engine_url, num_speculative_tokens=0)
            await tuner.sync_new_pods()  # nothing new: no request to the configured pod
            seen.append(engine_config(engine_url)["num_speculative_tokens"])
            ready.append(second)  # scale-up: a new ready pod
            await tuner.sync_new_pods()
            seen.append(engine_config(engine_url)["num_speculative_tokens"])
            return seen
        finally:
            await tuner.actuator.close()

    engine_set(engine_url, num_speculative_tokens=0)
    assert asyncio.run(scenario()) == [5, 0, 5]
