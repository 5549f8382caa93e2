"""What keeps the tuner's learning across a /scale write and an operator restart: the spec fingerprint it is
rebuilt on, and the `status.tuning.resume` snapshot a fresh policy continues from."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from specfleet.operator import load_inference_service
from specfleet.operator.crd import build_crd
from specfleet.tuner.loop import tuner_fingerprint
from specfleet.tuner.policy import Policy
from specfleet.tuner.policy.resume import restore, snapshot
from specfleet.tuner.report import tuning_status
from specfleet.tuner.types import TunedConfig

from .plant import Plant
from .test_policy import PARAMS, run

REPO = Path(__file__).resolve().parents[2]
DOC = yaml.safe_load((REPO / "examples" / "llama3-8b-autotune.yaml").read_text())


def fingerprint(**spec: Any) -> str:
    doc = copy.deepcopy(DOC)
    doc["spec"].update(spec)
    return tuner_fingerprint(load_inference_service(doc).spec)


def test_scaling_and_pod_settings_keep_the_fingerprint_and_tuner_inputs_change_it() -> None:
    base = fingerprint()
    assert fingerprint(replicas=7) == base
    assert fingerprint(rollout={"strategy": "Recreate"}) == base
    assert fingerprint(pod={"labels": {"team": "search"}}) == base
    assert fingerprint(scheduling={"priorityClassName": "high"}) == base
    frozen = {**DOC["spec"]["autotune"], "freeze": True}
    assert fingerprint(autotune=frozen) == base  # a freeze holds the config; lifting it keeps the learning
    assert fingerprint(slo={"ttftP95Ms": 400, "tpotP95Ms": 40}) != base
    autotune = copy.deepcopy(DOC["spec"]["autotune"])
    autotune["intervalSeconds"] = 60
    assert fingerprint(autotune=autotune) != base
    model = {**DOC["spec"]["model"], "source": "hf://meta-llama/Llama-3.1-8B-Instruct"}
    assert fingerprint(model=model) != base


def _learned() -> tuple[Policy, float]:
    policy = Policy(PARAMS)
    steps = 14
    run(Plant(demand=2, shadow=True), policy, TunedConfig(0, 16, 512), steps)
    assert policy.memory.cost_points and policy.memory.acceptance, "the run taught the policy nothing"
    # speculation off at first (shadow drafts), then on (verified ones): the snapshot keeps which is which
    assert {shadow for *_, shadow in policy.memory.acceptance} == {True, False}
    return policy, (steps - 1) * PARAMS.interval_s


def test_a_restored_policy_continues_with_what_was_learned() -> None:
    policy, now = _learned()
    data = json.loads(json.dumps(snapshot(policy, now, "abc")))  # through status: JSON and back
    tuning = {
        "numSpeculativeTokens": policy.current.num_speculative_tokens,
        "maxNumSeqs": policy.current.max_num_seqs,
        "maxNumBatchedTokens": policy.current.max_num_batched_tokens,
        "speculativeDisableByBatchSize": policy.guard,
        "resume": data,
    }
    later = 5000.0  # another process: another monotonic clock
    fresh = Policy(PARAMS)
    assert restore(fresh, tuning, later, "abc")
    assert (
        fresh.current == policy.current and fresh.last_good == policy.current and fresh.guard == policy.guard
    )
    assert list(fresh.memory.cost_points) == [
        tuple(float(f"{x:.6g}") for x in p) for p in policy.memory.cost_points
    ]
    assert fresh.memory.knee(PARAMS.model) == policy.memory.knee(PARAMS.model)
    # acceptance keeps its age, so the TTL goes on counting from when it was measured
    ages = [(now - seen, shadow) for _, _, _, seen, shadow in policy.memory.acceptance]
    assert [(later - seen, shadow) for _, _, _, seen, shadow in fresh.memory.acceptance] == ages


def test_a_snapshot_of_another_spec_or_a_broken_one_is_ignored() -> None:
    policy, now = _learned()
    tuning = {
        "numSpeculativeTokens": 4,
        "maxNumSeqs": 16,
        "maxNumBatchedTokens": 512,
        "resume": snapshot(policy, now, "abc"),
    }
    fresh = Policy(PARAMS, TunedConfig(2, 8, 256))
    assert not restore(fresh, tuning, now, "other")
    assert fresh.current == TunedConfig(2, 8, 256) and not fresh.memory.cost_points
    broken = copy.deepcopy(tuning)
    broken["resume"]["costPoints"] = [[1.0, 2.0]]
    assert not restore(fresh, broken, now, "abc")
    assert not restore(fresh, {"resume": tuning["resume"]}, now, "abc")  # no config in force
    assert fresh.current == TunedConfig(2, 8, 256)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Undeclared fields as errors: what the API server's structural pruning would silently drop."""
    out = dict(schema)
    if "properties" in out:
        out["additionalProperties"] = False
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    return out


def _without_nulls(value: Any) -> Any:
    """A merge patch's nulls delete keys: what the API server stores has none."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def test_the_snapshot_fits_the_status_schema() -> None:
    """Everything the snapshot holds is declared in the CRD, so the API server keeps it."""
    policy, now = _learned()
    status = {"tuning": {**tuning_status_for(policy), "resume": snapshot(policy, now, "0123456789abcdef")}}
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    jsonschema.validate(_without_nulls(json.loads(json.dumps(status))), _strict(schema))
    assert status["tuning"]["resume"]["costPoints"] and status["tuning"]["resume"]["acceptance"]


def tuning_status_for(policy: Policy) -> dict[str, Any]:
    from specfleet.tuner.loop import Tick
    from specfleet.tuner.types import Decision, Observation

    tick = Tick(
        Decision(0.0, None, "holding", "hold"), Observation(time=0.0, config=None), None, policy.guard
    )
    return tuning_status(tick, policy.current, None, "2026-12-01T00:00:00Z")
