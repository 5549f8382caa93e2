"""The speculative methods are declared once (`specfleet.engine.spec_decode.methods`): walk every declared
method through each part that names one — the engine's config checks and builder, vLLM's spellings, the
CRD's admission (schema and CEL) and its pydantic twin, the rendered engine command line as the engine
parses it, and the benchmarks' specs. The expectations come from the declaration, so a method added there
without its builder, or a part that keeps its own list, fails here."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from isvc_schema_tools import EXAMPLES, admission_errors
from specfleet.bench.spec import method_kwargs
from specfleet.bench.tune import _speculative
from specfleet.engine.config import EngineConfig
from specfleet.engine.llm import engine_config_from_vllm_kwargs
from specfleet.engine.server.cli import build_parser, engine_config_kwargs
from specfleet.engine.spec_decode.factory import builder
from specfleet.engine.spec_decode.methods import (
    METHODS,
    NONE,
    SPECULATIVE_METHODS,
    VLLM_DRAFT_MODEL,
    VLLM_NAMES,
    SpeculativeMethod,
    method,
)
from specfleet.operator import InvalidInferenceService, load_inference_service
from specfleet.operator.config import OperatorConfig
from specfleet.operator.render import render_deployment

BUNDLED = "bundled://smollm2-135m-instruct"
CPU = yaml.safe_load((EXAMPLES[0].parent / "smollm2-cpu.yaml").read_text())
DECLARED = pytest.mark.parametrize("spec", list(METHODS.values()), ids=list(METHODS))


def _draft(spec: SpeculativeMethod) -> dict[str, Any]:
    return {"draft_model": BUNDLED} if spec.needs_draft_model else {}


def _isvc(method_name: str, draft_model: bool) -> dict[str, Any]:
    doc = copy.deepcopy(CPU)
    doc["metadata"].update(namespace="team-a", uid="uid-1", generation=1)
    doc["spec"]["speculative"] = {
        "method": method_name,
        "numSpeculativeTokens": 2,
        **({"draftModel": {"source": BUNDLED, "quantization": "int8"}} if draft_model else {}),
    }
    return doc


def test_the_declaration_is_consistent() -> None:
    assert SPECULATIVE_METHODS == (NONE, *METHODS) and NONE not in METHODS
    assert all(name == spec.name for name, spec in METHODS.items())
    assert VLLM_NAMES[VLLM_DRAFT_MODEL] in METHODS and METHODS[VLLM_NAMES[VLLM_DRAFT_MODEL]].needs_draft_model
    with pytest.raises(ValueError, match=r"speculative_method='eagle' is not one of \('none', "):
        method("eagle")


@DECLARED
def test_engine_config_accepts_each_method_with_what_it_needs(spec: SpeculativeMethod) -> None:
    config = EngineConfig(speculative_method=spec.name, num_speculative_tokens=2, **_draft(spec))
    assert method(config.speculative_method) is spec
    assert config.speculative_tokens_limit == config.max_num_speculative_tokens
    if spec.needs_draft_model:
        with pytest.raises(ValueError, match=f"speculative_method='{spec.name}' needs draft_model"):
            EngineConfig(speculative_method=spec.name)
        EngineConfig(speculative_method=spec.name, draft_model=BUNDLED, draft_quantization="int8")
    else:
        with pytest.raises(ValueError, match="draft_quantization needs speculative_method="):
            EngineConfig(speculative_method=spec.name, draft_quantization="int8")
    assert callable(builder(spec.builder)), f"{spec.name}'s builder {spec.builder} is not a function"


@DECLARED
def test_vllm_spellings_select_the_method(spec: SpeculativeMethod) -> None:
    assert spec.vllm_names, f"{spec.name} has no vLLM spelling"
    for alias in spec.vllm_names:
        extra = {"model": BUNDLED} if spec.needs_draft_model else {}
        kwargs = {"speculative_config": {"method": alias, "num_speculative_tokens": 2, **extra}}
        config = engine_config_from_vllm_kwargs(BUNDLED, kwargs)
        assert (config.speculative_method, config.draft_model) == (spec.name, extra.get("model"))


def test_no_method_and_k_is_refused_naming_every_method() -> None:
    with pytest.raises(ValueError, match=" or ".join(f"'{name}'" for name in METHODS)):
        EngineConfig(num_speculative_tokens=1)


@DECLARED
def test_admission_and_its_twin_take_a_draft_model_exactly_when_the_method_needs_one(
    spec: SpeculativeMethod,
) -> None:
    right = _isvc(spec.name, draft_model=spec.needs_draft_model)
    assert admission_errors(right) == []
    load_inference_service(right)
    wrong = _isvc(spec.name, draft_model=not spec.needs_draft_model)
    assert any("draftModel" in error for error in admission_errors(wrong)), admission_errors(wrong)
    with pytest.raises(InvalidInferenceService, match="draftModel"):
        load_inference_service(wrong)


@DECLARED
def test_the_rendered_command_line_starts_an_engine_of_the_method(spec: SpeculativeMethod) -> None:
    isvc = load_inference_service(_isvc(spec.name, draft_model=spec.needs_draft_model))
    config = OperatorConfig(engine_image="engine:cuda", engine_cpu_image="engine:cpu")
    args = render_deployment(isvc, config)["spec"]["template"]["spec"]["containers"][0]["args"]
    engine = EngineConfig(**engine_config_kwargs(build_parser().parse_args(args)))
    assert engine.speculative_method == spec.name and engine.num_speculative_tokens == 2
    assert (engine.draft_model, engine.draft_quantization) == (
        (BUNDLED, "int8") if spec.needs_draft_model else (None, None)
    )


@DECLARED
def test_the_benchmarks_build_a_valid_spec_for_each_method(spec: SpeculativeMethod) -> None:
    kwargs: dict[str, Any] = dict(method_kwargs(BUNDLED, "int8")[spec.name])
    assert EngineConfig(**kwargs).speculative_method == spec.name
    doc = copy.deepcopy(CPU)
    doc["spec"]["speculative"] = _speculative(spec.name)
    assert admission_errors(doc) == []
    assert spec.needs_draft_model == ("draftModel" in doc["spec"]["speculative"])
    assert spec.name not in method_kwargs("none", "none") or not spec.needs_draft_model
