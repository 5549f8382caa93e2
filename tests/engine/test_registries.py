"""The registries a contributor extends: each name the config accepts has an entry, and nothing unknown
falls through to a default."""

from __future__ import annotations

import pytest
import torch
from specfleet.engine.attention.registry import ATTENTION_BACKENDS, get_attention_backend
from specfleet.engine.config import ATTENTION_BACKENDS as CONFIG_BACKENDS
from specfleet.engine.config import SPECULATIVE_METHODS, EngineConfig
from specfleet.engine.models import ARCHITECTURES, model_class
from specfleet.engine.models.llama import LlamaModel
from specfleet.engine.spec_decode.factory import build_proposer
from specfleet.engine.spec_decode.methods import METHODS


def test_every_configurable_name_has_an_entry():
    assert set(CONFIG_BACKENDS) == {"auto", *ATTENTION_BACKENDS}
    assert set(SPECULATIVE_METHODS) == {"none", *METHODS}


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="'torch', 'native', 'triton'"):
        get_attention_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        model_class(["GPT2LMHeadModel"])
    config = EngineConfig()
    object.__setattr__(config, "speculative_method", "eagle")  # past EngineConfig's own check
    with pytest.raises(
        ValueError, match="speculative_method='eagle' is not one of \\('none', 'ngram', 'draft'\\)"
    ):
        build_proposer(config, None, None, 1)


def test_registered_architectures_load_the_llama_family_class():
    assert all(issubclass(model_class([name]), LlamaModel) for name in ARCHITECTURES)
    for name in ARCHITECTURES:  # each names itself in errors; the ones on LlamaModel as Llama's family
        assert model_class([name]).architecture in (name, "LlamaForCausalLM")
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"


def test_model_sources_refuse_an_unknown_scheme_naming_the_known_ones():
    from specfleet.engine.model_source import resolve_model

    with pytest.raises(ValueError, match="use bundled://, file://, pvc://, hf://"):
        resolve_model("s3://bucket/model")
    with pytest.raises(ValueError, match="expected pvc://<claim>/<path>"):
        resolve_model("pvc:///x")
