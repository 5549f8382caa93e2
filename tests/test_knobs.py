"""The live knobs are declared once (`specfleet.engine.knobs`): walk the declaration and check that every
part that names a knob knows each of them: the engine's limits, the admin API, the config gauges, the
tuner's config, bounds and both readers (the direct scrape and PromQL), the CRD's autotune bounds and the
tuning status, and the simulator (its engines' limits and refusals, and no knob named by hand in sim/).
The expectations come from the declaration, so a part that hard-codes its own list and misses a knob
fails here."""

from __future__ import annotations

import ast
import asyncio
import random
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from specfleet.engine.config import SPECULATIVE_METHODS, EngineConfig
from specfleet.engine.knobs import (
    ALL_KNOBS,
    ENGINE,
    KNOBS,
    REPLICAS,
    RULED,
    SEARCHED,
    SERVICE,
    SERVICE_KNOBS,
    LiveConfig,
    ServiceConfig,
    camel,
    check_fields,
    get_knob,
)
from specfleet.engine.python_child import python_command
from specfleet.operator.crd import model_schema
from specfleet.operator.spec import AutotuneBounds, InferenceServiceSpec, knob_limits
from specfleet.operator.status import TuningStatus
from specfleet.tuner.snapshot import parse_metrics
from specfleet.tuner.sources import PrometheusSource
from specfleet.tuner.types import LiveSettings, TuneBounds, TunedConfig

NAMES = [k.name for k in KNOBS]
# A distinct value per knob, so that a reader that swaps two knobs fails too.
VALUES = {k.name: k.minimum + 3 + 2 * i for i, k in enumerate(KNOBS)}
SPEC = {"model": {"source": "bundled://smollm2-135m-instruct"}, "speculative": {"method": "ngram"}}


def test_declaration_is_well_formed() -> None:
    assert NAMES == [f.name for f in fields(LiveConfig)] and len(set(NAMES)) == len(NAMES)
    assert sorted(SEARCHED + RULED, key=KNOBS.index) == list(KNOBS)
    assert all(k.searched for k in SEARCHED) and not any(k.searched for k in RULED)
    engine = EngineConfig(speculative_method="ngram")
    for knob in KNOBS:
        assert get_knob(knob.name) is knob
        assert knob.name in {f.name for f in fields(EngineConfig)}, (
            f"EngineConfig lacks {knob.name}'s start value"
        )
        assert isinstance(getattr(engine, knob.ceiling), int), (
            f"{knob.name}'s ceiling {knob.ceiling} is not on EngineConfig"
        )
        assert knob.gauge == f"specfleet_{knob.name}" and knob.help
        above = getattr(engine, knob.ceiling) + 1
        raised = EngineConfig(speculative_method="ngram", **{knob.ceiling_field: above})
        assert getattr(raised, knob.ceiling) == above, f"{knob.ceiling_field} does not set {knob.ceiling}"
        if knob.searched:
            assert knob.search and knob.minimum <= knob.search[0] <= knob.search[1], knob
            assert knob.spec_path, f"{knob.name} is searched but the spec has no start value for it"
    with pytest.raises(KeyError, match="not a live knob"):
        get_knob("replicas_typo")


def test_engine_limits_come_from_the_declaration() -> None:
    """update_config's limits are (minimum, EngineConfig.<ceiling>) for every knob."""
    from specfleet.engine.llm_engine import Engine
    from specfleet.engine.sampling_params import ParameterError

    engine = Engine.__new__(Engine)  # the limits need only the config: no model
    engine.config = EngineConfig(speculative_method="ngram")
    for knob in KNOBS:
        with pytest.raises(ParameterError) as below:
            engine.update_config(**{knob.name: knob.minimum - 1})
        assert below.value.param == knob.name
        high = getattr(engine.config, knob.ceiling)
        with pytest.raises(ParameterError, match=f"between {knob.minimum} and {high}"):
            engine.update_config(**{knob.name: high + 1})


def test_admin_api_knows_every_knob() -> None:
    from specfleet.engine.server.protocol import AdminConfigPatch

    assert list(AdminConfigPatch.model_fields) == NAMES
    assert AdminConfigPatch(**VALUES).changes() == VALUES
    for knob in KNOBS:
        assert AdminConfigPatch(**{knob.name: knob.minimum}).changes() == {knob.name: knob.minimum}
        with pytest.raises(ValidationError):
            AdminConfigPatch(**{knob.name: knob.minimum - 1})
    with pytest.raises(ValidationError):
        AdminConfigPatch(not_a_knob=1)
    assert LiveConfig(**VALUES).as_dict() == VALUES  # the GET body


def _rendered(values: dict[str, int]) -> str:
    from specfleet.engine.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.set_live_config(LiveConfig(**values))
    return metrics.render().decode()


def test_gauges_and_both_tuner_readers_know_every_knob() -> None:
    text = _rendered(VALUES)
    for knob in KNOBS:
        assert f"# HELP {knob.gauge} {knob.help}" in text
        assert f'{knob.gauge}{{model_name="m"}} {float(VALUES[knob.name])}' in text
    searched = TunedConfig(**{k.name: VALUES[k.name] for k in SEARCHED})
    # the direct scrape
    assert parse_metrics(text, 0.0).config() == searched
    # PromQL: one min and one max query per searched knob, on its gauge; the config read from their answers
    source = PrometheusSource("http://prometheus.invalid", 'job="x"')
    queries = source.queries()
    for knob in SEARCHED:
        assert queries[f"min:{knob.name}"] == f'min({knob.gauge}{{job="x"}})'
        assert queries[f"max:{knob.name}"] == f'max({knob.gauge}{{job="x"}})'

    async def answer(promql: str) -> list[dict[str, Any]]:
        if promql.startswith("count("):
            return [{"metric": {}, "value": [0, "1"]}]
        knob = next(
            (k for k in SEARCHED if promql.startswith(("min(" + k.gauge + "{", "max(" + k.gauge + "{"))), None
        )
        return [{"metric": {}, "value": [0, str(VALUES[knob.name])]}] if knob else []

    source._query = answer
    assert asyncio.run(source.observe()).config == searched


def test_tuner_types_know_every_knob() -> None:
    assert [f.name for f in fields(TunedConfig)] == [k.name for k in SEARCHED]
    config = TunedConfig(**{k.name: VALUES[k.name] for k in SEARCHED})
    assert config.as_admin() == {k.name: VALUES[k.name] for k in SEARCHED}
    assert TunedConfig.from_admin(VALUES) == config
    assert config.short() == " ".join(f"{k.label}={VALUES[k.name]}" for k in SEARCHED)
    ruled = {k.name: VALUES[k.name] for k in RULED}
    assert LiveSettings(config, **ruled).as_admin() == VALUES  # every knob reaches the engines, typed
    assert LiveSettings(config).as_admin() == config.as_admin()  # None: left as the engine has it
    bounds = TuneBounds()
    for knob in SEARCHED:
        assert bounds[knob.name] == getattr(bounds, knob.label) == knob.search
        narrow = TuneBounds(**{knob.name: (knob.minimum, knob.minimum)})
        assert getattr(narrow.clamp(config), knob.name) == knob.minimum
    with pytest.raises(KeyError, match="not a searched knob"):
        TuneBounds(not_a_knob=(0, 1))


def _raised_service() -> tuple[Any, dict[str, int], dict[str, int]]:
    """An InferenceService whose every searched knob starts at a value and is bounded by a ceiling that
    differ from the engine's defaults; returns it with the start values and the ceilings."""
    from specfleet.operator.inference_service import load_inference_service

    start = {k.name: (k.search or (0, 0))[0] + 1 for k in SEARCHED}  # inside what the CRD accepts
    high = {k.name: (k.search or (0, 0))[1] + 5 + i for i, k in enumerate(SEARCHED)}
    spec: dict[str, Any] = {**SPEC, "speculative": dict(SPEC["speculative"])}
    for knob in SEARCHED:
        *parents, leaf = (knob.spec_path or "").split(".")
        node = spec
        for part in parents:
            node = node.setdefault(camel(part), {})
        node[camel(leaf)] = start[knob.name]
    spec["autotune"] = {"bounds": {k.crd_name: [k.minimum, high[k.name]] for k in SEARCHED}}
    isvc = load_inference_service(
        {
            "apiVersion": "serving.specfleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "knobs"},
            "spec": spec,
        }
    )
    return isvc, start, high


def _pod_config(isvc: Any) -> EngineConfig:
    """The EngineConfig a pod of `isvc` runs: the operator's engine flags, read by the engine's parser."""
    from specfleet.engine.server.cli import build_parser, engine_config_kwargs
    from specfleet.operator.render.deployment import engine_args

    args = engine_args(isvc.spec, "bundled://smollm2-135m-instruct", None)
    return EngineConfig(**engine_config_kwargs(build_parser().parse_args(args)))


def test_engine_command_lines_set_every_searched_knob() -> None:
    """The engine flags the operator's Deployment passes set each searched knob's start value from the spec,
    and raise its ceiling over the tuner's bounds (a pod whose ceiling stayed the engine's default refused
    the tuner's higher values), as `specfleet up`'s engines do; the engine's own parser reads both back. Every value differs from the engine's default, so a missing flag fails."""
    from specfleet.engine.server.cli import build_parser, engine_config_kwargs
    from specfleet.fleet.supervisor import local_engine_command

    isvc, start, high = _raised_service()

    def parsed(args: list[str]) -> EngineConfig:
        return EngineConfig(**engine_config_kwargs(build_parser().parse_args(args)))

    pod = _pod_config(isvc)
    command = local_engine_command(isvc, 9000)
    local = parsed(command[command.index("specfleet.engine") + 1 :])  # past `python -P -m specfleet.engine`
    default = EngineConfig(speculative_method="ngram")
    for knob in SEARCHED:
        assert getattr(pod, knob.name) == getattr(local, knob.name) == start[knob.name]
        assert getattr(pod, knob.ceiling) == getattr(local, knob.ceiling) == high[knob.name]
        assert high[knob.name] != getattr(default, knob.ceiling)


def test_simulated_engines_have_the_pods_limits_and_refusals() -> None:
    """The simulator's engine starts with every knob's ceiling a pod of the same spec has (derived from the
    declaration, not listed), and refuses a value outside [minimum, ceiling] with the engine's own
    message, naming the knob and the limit."""
    from specfleet.engine.config import check_live
    from specfleet.engine.sampling_params import ParameterError
    from specfleet.sim.engine import SimEngine
    from specfleet.sim.fleet import start_limits
    from specfleet.sim.profile import Profile

    isvc, _, _ = _raised_service()
    pod = _pod_config(isvc)
    limits = start_limits(isvc.spec)
    profile = Profile("p", "measured", False, ((1, 0.02), (8, 0.02)), num_kv_blocks=64, block_size=16)
    live = LiveConfig(**{k.name: k.minimum for k in KNOBS})
    engine = SimEngine(0, profile, live, limits, block_size=16, prefix_caching=True, rng=random.Random(0))
    for knob in KNOBS:
        high = getattr(pod, knob.ceiling)
        assert getattr(limits.ceilings, knob.name) == high, knob.name
        for value in (knob.minimum - 1, high + 1):
            with pytest.raises(ParameterError) as refused:
                check_live(pod, {knob.name: value})
            assert engine.update_config(**{knob.name: value}) == str(refused.value), knob.name
        assert engine.update_config(**{knob.name: high}) is None
        assert engine.live_config().as_dict()[knob.name] == high


def test_the_simulator_names_no_engine_knob_by_hand() -> None:
    """sim/ reaches every engine knob through the declaration (limits, refusals, the timeline's plot): a
    knob's name written as a string there is a hand-made twin that a new knob would miss (a KeyError, or
    a knob left out)."""
    import specfleet.sim

    names = {k.name for k in KNOBS}
    found = []
    for path in sorted(Path(specfleet.sim.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"sim/{path.name}:{node.lineno} {node.value!r}")
    assert not found, f"knob names written by hand in the simulator: {found}"


def test_typed_copies_fail_at_import_when_a_knob_is_missing() -> None:
    @dataclass(frozen=True)
    class Short:
        num_speculative_tokens: int

    with pytest.raises(TypeError, match="max_num_seqs"):
        check_fields(Short, tuple(k.name for k in SEARCHED), "one per searched knob")


def test_crd_knows_every_searched_knob() -> None:
    assert list(AutotuneBounds.model_fields) == [k.name for k in SEARCHED]
    schema = model_schema(InferenceServiceSpec)
    bounds = schema["properties"]["autotune"]["properties"]["bounds"]
    rules = " ".join(r["rule"] for r in bounds["x-kubernetes-validations"])
    spec_rules = " ".join(r["rule"] for r in schema["x-kubernetes-validations"])
    for knob in SEARCHED:
        assert bounds["properties"][knob.crd_name]["default"] == list(knob.search or ())
        assert f"self.{knob.crd_name}[0] <= self.{knob.crd_name}[1]" in rules
        assert f"self.autotune.bounds.{knob.crd_name}[0]" in spec_rules
    spec = InferenceServiceSpec.model_validate(SPEC)
    assert list(spec.start_values()) == [k.name for k in SEARCHED]
    assert spec.tuned_bounds() == {k.name: k.search for k in SEARCHED}
    wide = {k.crd_name: [k.minimum, k.minimum] for k in SEARCHED}
    for knob in SEARCHED:  # autotune on: each start value must lie inside its bounds (the Python twin of CEL)
        with pytest.raises(ValidationError, match=f"autotune.bounds.{knob.crd_name}"):
            InferenceServiceSpec.model_validate(
                {
                    **SPEC,
                    "autotune": {
                        "enabled": True,
                        "bounds": {
                            **{k.crd_name: [k.minimum, knob_limits(k)[1]] for k in SEARCHED},
                            knob.crd_name: wide[knob.crd_name],
                        },
                    },
                }
            )
    status = model_schema(TuningStatus)["properties"]
    assert all(camel(k.name) in status for k in KNOBS)


def test_speculative_methods_have_one_home() -> None:
    from specfleet.engine.server.cli import build_parser

    schema = model_schema(InferenceServiceSpec)
    assert tuple(schema["properties"]["speculative"]["properties"]["method"]["enum"]) == SPECULATIVE_METHODS
    action = next(a for a in build_parser()._actions if a.dest == "speculative_method")
    assert tuple(action.choices or ()) == SPECULATIVE_METHODS


def test_the_operator_and_the_tuner_import_the_declaration_without_torch() -> None:
    code = (
        "import sys, specfleet.operator.spec, specfleet.operator.status, specfleet.tuner.loop, "
        "specfleet.tuner.sources, specfleet.tuner.report; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(python_command("-c", code), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_service_knobs_are_declared_once_and_skipped_by_the_engine() -> None:
    """`replicas` travels through the same registry as k and batch limits: declared in ServiceConfig with its
    scope, refused by name by the admin API, absent from the engine gauges and status.tuning, and named,
    defaulted and bounded from its declaration in spec.autoscaling, status.autoscaling, the replica
    policy and the router's gauge."""
    from specfleet.engine.server.protocol import AdminConfigPatch
    from specfleet.operator.spec import AutoscalingSpec
    from specfleet.operator.status import AutoscalingStatus
    from specfleet.router.endpoints import EndpointSet
    from specfleet.router.metrics import RouterMetrics
    from specfleet.tuner.policy.replicas import ReplicaDecision, ReplicaParams
    from specfleet.tuner.report import autoscaling_status

    assert [k.name for k in SERVICE_KNOBS] == [f.name for f in fields(ServiceConfig)] == [REPLICAS.name]
    assert all(k.scope == ENGINE for k in KNOBS) and all(k.scope == SERVICE for k in SERVICE_KNOBS)
    assert ALL_KNOBS == KNOBS + SERVICE_KNOBS and get_knob(REPLICAS.name) is REPLICAS
    assert ServiceConfig().as_dict() == {REPLICAS.name: 1}
    for knob in SERVICE_KNOBS:
        assert knob.name not in NAMES, (
            "a service knob must not be a LiveConfig field (the engine cannot apply it)"
        )
        with pytest.raises(ValidationError, match=f"{knob.name} is a service knob"):
            AdminConfigPatch(**{knob.name: 2})
        assert knob.gauge not in _rendered(VALUES)  # the engine's exposition skips it
        assert knob.crd_name not in model_schema(TuningStatus)["properties"]
    low, high = REPLICAS.search or (0, 0)
    scaling = model_schema(AutoscalingSpec)["properties"]
    assert (scaling["minReplicas"]["default"], scaling["maxReplicas"]["default"]) == (low, high)
    assert scaling["minReplicas"]["minimum"] == REPLICAS.minimum
    assert (
        model_schema(InferenceServiceSpec)["properties"][REPLICAS.spec_path or ""]["minimum"]
        == REPLICAS.minimum
    )
    assert (ReplicaParams().min_replicas, ReplicaParams().max_replicas) == (low, high)
    assert REPLICAS.ceiling == "autoscaling.max_replicas" and hasattr(AutoscalingSpec(), "max_replicas")
    status = model_schema(AutoscalingStatus)["properties"]
    assert status[REPLICAS.crd_name]["minimum"] == REPLICAS.minimum
    written = autoscaling_status(ReplicaDecision(0.0, 2, 1, "scale-up", "why"), None, "now")
    assert written[REPLICAS.crd_name] == 2 and AutoscalingStatus.model_validate(written)
    metrics = RouterMetrics()
    endpoints = EndpointSet(["http://a", "http://b", "http://c"], ready=True)
    endpoints.set_state("http://c", draining=True)
    metrics.observe_endpoints(endpoints)
    assert metrics.registry.get_sample_value(REPLICAS.gauge) == 2.0  # draining engines are on their way out
