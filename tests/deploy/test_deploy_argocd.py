"""The Argo CD health check for InferenceService, run by a real Lua 5.1 runtime (lupa) on Argo CD's own test
format, and the Flux health expressions (CEL) checked against the same fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from specfleet.operator.conditions import Workload, build_status
from specfleet.operator.inference_service import parse_inference_service

lua51 = pytest.importorskip("lupa.lua51", reason="lupa is a test extra: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "argocd" / "inferenceservice-health.lua"
FIXTURES = REPO / "tests" / "fixtures" / "argocd-health"
CASES = yaml.safe_load((FIXTURES / "health_test.yaml").read_text())["tests"]
# Argo CD runs health scripts in gopher-lua (Lua 5.1) with only these libraries open: no os, io or require.
SAFE_GLOBALS = (
    "ipairs",
    "pairs",
    "next",
    "tostring",
    "tonumber",
    "type",
    "select",
    "unpack",
    "error",
    "pcall",
    "string",
    "table",
    "math",
)


def argocd_health(obj: dict[str, Any]) -> dict[str, str]:
    """What Argo CD would show: the script run with `obj` as its only input, in a sandbox of safe globals."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    env = lua.table_from({name: lua.globals()[name] for name in SAFE_GLOBALS})
    env["obj"] = lua.table_from(obj, recursive=True)
    chunk = lua.globals().loadstring(SCRIPT.read_text(), "health.lua")
    assert not isinstance(chunk, tuple), f"health.lua does not compile: {chunk}"
    lua.globals().setfenv(chunk, env)
    result = chunk()
    return {"status": result["status"], "message": result["message"]}


@pytest.mark.parametrize("case", CASES, ids=[Path(c["inputPath"]).stem for c in CASES])
def test_health_matches_the_fixture(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((FIXTURES / case["inputPath"]).read_text())
    assert argocd_health(obj) == case["healthStatus"]


def test_fixtures_cover_every_health_status_and_return() -> None:
    assert {c["healthStatus"]["status"] for c in CASES} == {"Healthy", "Progressing", "Degraded", "Suspended"}
    # every `return hs` in the script is reached by some fixture
    returns = SCRIPT.read_text().count("return hs")
    reached = set()
    for case in CASES:
        obj = yaml.safe_load((FIXTURES / case["inputPath"]).read_text())
        reached.add(_branch(obj))
    assert len(reached) == returns, f"{returns} returns, fixtures reach {sorted(reached)}"


def _branch(obj: dict[str, Any]) -> int:
    """Index of the `return hs` the script takes for obj (the script instrumented with a return counter)."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    parts = SCRIPT.read_text().split("return hs")
    instrumented = (
        "".join(f"{part}hs.branch = {i}; return hs" for i, part in enumerate(parts[:-1])) + parts[-1]
    )
    lua.globals()["obj"] = lua.table_from(obj, recursive=True)
    return int(lua.execute(instrumented)["branch"])


def test_a_stale_healthy_status_is_never_healthy() -> None:
    obj = yaml.safe_load((FIXTURES / "testdata" / "healthy.yaml").read_text())
    assert argocd_health(obj)["status"] == "Healthy"
    obj["metadata"]["generation"] += 1  # a spec just applied; the operator has not seen it yet
    assert argocd_health(obj)["status"] == "Progressing"


FLUX_KUSTOMIZATION = REPO / "deploy" / "gitops-examples" / "flux-kustomization.yaml"
_CEL = celpy.Environment()


def flux_health(obj: dict[str, Any]) -> str:
    """Flux's order for healthCheckExprs: inProgress, then failed, then current; an error means waiting."""
    (kustomization,) = [
        d for d in yaml.safe_load_all(FLUX_KUSTOMIZATION.read_text()) if d["kind"] == "Kustomization"
    ]
    (exprs,) = kustomization["spec"]["healthCheckExprs"]
    activation = {k: celpy.json_to_cel(v) for k, v in obj.items()}
    for outcome in ("inProgress", "failed", "current"):
        result = _CEL.program(_CEL.compile(exprs[outcome])).evaluate(activation)
        if isinstance(result, Exception):
            return "InProgress"
        if bool(result):
            return {"inProgress": "InProgress", "failed": "Failed", "current": "Current"}[outcome]
    return "InProgress"


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if "terminating" not in c["inputPath"]],
    ids=[Path(c["inputPath"]).stem for c in CASES if "terminating" not in c["inputPath"]],
)
def test_flux_health_expressions_agree_with_the_lua(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((FIXTURES / case["inputPath"]).read_text())
    expected = {
        "Healthy": "Current",
        "Suspended": "Current",
        "Degraded": "Failed",
        "Progressing": "InProgress",
    }[case["healthStatus"]["status"]]
    assert flux_health(obj) == expected


def _operator_verdict(spec: dict[str, Any], deployment: dict[str, Any], tuned: int | None) -> dict[str, Any]:
    """The InferenceService as the operator leaves it: its status from the operator's own build_status over
    a Deployment the Deployment controller has observed (`tuned`: the tuner's status.autoscaling.replicas)."""
    document: dict[str, Any] = {
        "apiVersion": "serving.specfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "team-a", "generation": 2},
        "spec": {"model": {"source": "bundled://smollm2-135m-instruct"}, **spec},
    }
    if tuned is not None:
        document["status"] = {"autoscaling": {"replicas": tuned}}
    isvc = parse_inference_service(document)
    workload = Workload("chat", isvc.desired_replicas, {"metadata": {"generation": 7}, "status": deployment})
    document["status"] = {
        **document.get("status", {}),
        **build_status(isvc, [workload], {}, "2026-12-07T00:00:00Z"),
    }
    return document


def _pods(replicas: int, updated: int, ready: int) -> dict[str, Any]:
    return {
        "observedGeneration": 7,
        "replicas": replicas,
        "updatedReplicas": updated,
        "availableReplicas": ready,
        "readyReplicas": ready,
    }


AUTOSCALED: dict[str, Any] = {
    "autotune": {"enabled": True},
    "autoscaling": {"enabled": True, "maxReplicas": 3},
}
ROUTED: dict[str, Any] = {"routing": {"queueTimeoutSeconds": 30}}


@pytest.mark.parametrize(
    ("spec", "deployment", "tuned", "argocd", "flux"),
    [
        # spec.replicas 0 under the autoscaler's minReplicas 1: one engine serves
        (
            {"replicas": 0, **AUTOSCALED, "autoscaling": {**AUTOSCALED["autoscaling"], "minReplicas": 1}},
            _pods(1, 1, 1),
            None,
            "Healthy",
            "Current",
        ),
        # the same engine not ready yet: waiting, not parked
        (
            {"replicas": 0, **AUTOSCALED, "autoscaling": {**AUTOSCALED["autoscaling"], "minReplicas": 1}},
            _pods(1, 1, 0),
            None,
            "Progressing",
            "InProgress",
        ),
        # spec.replicas 0 while the last engines drain: a rollout still runs
        ({"replicas": 0}, _pods(2, 2, 2), None, "Progressing", "InProgress"),
        ({"replicas": 0}, _pods(0, 0, 0), None, "Suspended", "Current"),
        # the tuner at minReplicas 0 took a spec.replicas of 1 to zero engines
        (
            {
                "replicas": 1,
                **ROUTED,
                **AUTOSCALED,
                "autoscaling": {**AUTOSCALED["autoscaling"], "minReplicas": 0},
            },
            _pods(0, 0, 0),
            0,
            "Suspended",
            "Current",
        ),
    ],
    ids=["autoscaled-from-0", "autoscaled-from-0-not-ready", "draining-to-0", "at-0", "tuner-at-0"],
)
def test_health_follows_the_operators_verdict_not_spec_replicas(
    spec: dict[str, Any], deployment: dict[str, Any], tuned: int | None, argocd: str, flux: str
) -> None:
    """The engines the operator runs are `desired_replicas` (the tuner's count clamped to the autoscaling
    bounds), not spec.replicas, and Ready=False/ScaledToZero says when there are none: the health check
    reads that verdict, and reports a scale-down to zero as Progressing until its last pod is gone."""
    obj = _operator_verdict(spec, deployment, tuned)
    health = argocd_health(obj)
    assert health["status"] == argocd, obj["status"]["conditions"]
    assert flux_health(obj) == flux, obj["status"]["conditions"]
    if argocd == "Suspended":  # the message names who scaled to zero: the spec, or the tuner
        assert ("tuner" in health["message"]) == (tuned is not None), health["message"]


def test_a_scale_down_says_what_is_left() -> None:
    """Fewer pods of the same template: the message counts the pods left to stop (it said "2/0 replicas
    available, all on the latest pod template" while two engines drained)."""
    health = argocd_health(_operator_verdict({"replicas": 0}, _pods(2, 2, 2), None))
    assert health == {
        "status": "Progressing",
        "message": "RollingOut: scaling down to 0 replicas: 2 pod(s) left to stop",
    }
    health = argocd_health(_operator_verdict({"replicas": 1}, _pods(3, 3, 3), None))
    assert health["message"] == "RollingOut: scaling down to 1 replicas: 2 pod(s) left to stop"
