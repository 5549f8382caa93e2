"""Llama, Mistral and Qwen2 (q/k/v bias) against transformers, on tiny random-weight models built here."""

from __future__ import annotations

import shutil

import pytest
import torch
from specfleet.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 5, 9, 200, 31, 7, 77, 1000, 4, 4, 4, 19, 23, 88, 90, 91, 92, 93, 5000],
    [42],
    [3, 1, 4, 1, 5, 9, 2, 6],
]


def _tiny(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None, architectures=["MistralForCausalLM"])
    return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_tiny_architecture_matches_transformers(kind, tmp_path, bundled_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # random weights large enough that greedy tokens vary
        for p in model.parameters():
            p.normal_(0, 0.2)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_path / name, tmp_path / name)
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
