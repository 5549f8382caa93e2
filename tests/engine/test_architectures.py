"""Llama, Mistral and Qwen2 (q/k/v bias) against transformers, on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from helpers import copy_tokenizer, tiny_config, tiny_model
from specfleet.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6],
]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_tiny_architecture_matches_transformers(kind, tmp_path, bundled_path):
    model = tiny_model(tiny_config(kind), std=0.2)  # random weights large enough that greedy tokens vary
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    model.save_pretrained(tmp_path)
    copy_tokenizer(bundled_path, tmp_path)
    model.generation_config.eos_token_id = None
    expected = []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0
            )
            expected.append(out[0, len(ids) :].tolist())
    llm = LLM(model=f"file://{tmp_path}", block_size=4)
    got = [
        r.outputs[0].token_ids
        for r in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ]
    assert got == expected
    assert len({tuple(e) for e in expected}) == len(expected)
