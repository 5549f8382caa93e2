"""Bad input raises a ValueError that names the field and the limit; a failed request leaks nothing."""

from __future__ import annotations

import pytest
from specfleet.engine import EngineConfig, SamplingParams
from specfleet.engine.model_source import resolve_model


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -2}, "top_k=-2"),
        ({"n": 0}, "n=0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens=5"),
        ({"presence_penalty": 3.0}, "presence_penalty=3.0"),
        ({"logprobs": 50}, "logprobs=50"),
    ],
)
def test_sampling_params_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"block_size": 12}, "block_size=12"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"speculative_method": "magic"}, "speculative_method='magic'"),
        ({"speculative_method": "draft"}, "needs draft_model"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens=9"),
        ({"max_num_seqs": 300, "max_num_seqs_limit": 256}, "max_num_seqs=300"),
        (
            {"speculative_disable_by_batch_size": -1},
            "speculative_disable_by_batch_size=-1 must be an integer >= 0",
        ),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
        (
            {"tensor_parallel_size": 2, "quantization": "gguf"},
            "quantization='gguf' with tensor_parallel_size=2",
        ),
        ({"quantization": "int4"}, "quantization='int4' is not one of"),
        ({"draft_quantization": "int8"}, "draft_quantization needs speculative_method='draft'"),
        (
            {"attention_backend": "flash"},
            "attention_backend='flash' is not one of auto, torch, native, triton",
        ),
    ],
)
def test_engine_config_names_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("gopher://x", "unknown source scheme 'gopher'"),
        ("bundled://gpt-5", "unknown bundled model"),
        ("file:///nonexistent/model", "does not exist"),
        ("", "give a source"),
    ],
)
def test_unknown_model_sources(source, words):
    with pytest.raises(ValueError, match=words):
        resolve_model(source)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    from specfleet.engine.checkpoint import load_hf_config

    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_hf_config(tmp_path)


@pytest.mark.slow
def test_engine_rejects_bad_requests_and_leaks_no_blocks():
    from specfleet.engine import Engine

    engine = Engine(max_model_len=64)
    cases = [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ("hi " * 80, SamplingParams(), "maximum context length is 64 tokens. However, your prompt has"),
        ("hello", SamplingParams(max_tokens=100), r"maximum context length is 64 tokens.*max_tokens=100"),
        ([1, 2, 10**9], SamplingParams(), r"prompt token ids must be in \[0, 49152\)"),
        (
            "hello",
            SamplingParams(stop_token_ids=[10**30], min_tokens=1),
            r"stop_token_ids must be in \[0, 49152\)",
        ),
    ]
    for prompt, params, words in cases:
        with pytest.raises(ValueError, match=words):
            engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", "hello", SamplingParams(max_tokens=50, temperature=0.8, seed=1))
    engine.step()
    assert engine.kv_blocks_in_use() > 0
    engine.abort("ok")
    assert engine.kv_blocks_in_use() == 0 and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_num_seqs=0 must be an integer between 1 and 256"):
        engine.update_config(max_num_seqs=0)
    with pytest.raises(ValueError, match="num_speculative_tokens=2 must be an integer between 0 and 0"):
        engine.update_config(num_speculative_tokens=2)
    with pytest.raises(
        ValueError, match="speculative_disable_by_batch_size=257 must be an integer between 0 and 256"
    ):
        engine.update_config(speculative_disable_by_batch_size=257)
    assert engine.update_config(max_num_seqs=8, max_num_batched_tokens=512).max_num_seqs == 8
